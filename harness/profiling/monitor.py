"""Loss, throughput and what the objective's user watches into DeepSpeed's monitors (TensorBoard, CSV), which the
plain engine never logs.

DeepSpeed writes Train/Samples/lr (and, with wall_clock_breakdown, its timers) itself; this adds
Train/Samples/train_loss, Train/Samples/eval_loss, Train/Samples/tokens_per_s, a mixture's
Train/Samples/train_loss/<source> and eval_loss/<source>, and Train/Samples/<name> for the other names an objective
watches (harness/config/readouts.py: reward, completions/mean_length, rewards_margin ...), on the same x axis (global
samples). The monitors write on rank 0 only. Needs the trainer to call on_record after it logs.
"""

from __future__ import annotations

from harness.config.objectives import all_tracked
from harness.config.readouts import keys

EVENTS = {"train": (("loss", "train_loss"), ("tokens_per_s", "tokens_per_s")),
          "eval": (("eval_loss", "eval_loss"),)}
WATCHED = all_tracked()


def _train_name(key: str) -> str:
    return f"train_{key}" if key.startswith("loss/") else key


class MonitorHook:
    def __init__(self, engine, dist):
        self.engine, self.dist = engine, dist

    def before_step(self, step: int) -> None:
        pass

    def after_step(self, step: int) -> None:
        return None

    def on_record(self, kind: str, step: int, record: dict) -> None:
        if not self.dist.is_main:
            return
        x = self.engine.global_samples
        events = [(f"Train/Samples/{name}", record[field], x) for field, name in EVENTS.get(kind, ())
                  if record.get(field) is not None]
        if kind == "train":
            events += [(f"Train/Samples/{_train_name(key)}", record[key], x) for key in keys(WATCHED, record)
                       if key != "loss"]
        else:  # a mixture's sources
            events += [(f"Train/Samples/{key}", value, x) for key, value in record.items()
                       if key.startswith("eval_loss/") and value is not None]
        if events:
            self.engine.monitor.write_events(events)

    def close(self) -> None:
        return None
