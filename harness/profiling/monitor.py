"""Loss and throughput into DeepSpeed's monitors (TensorBoard, CSV), which the plain engine never logs.

DeepSpeed writes Train/Samples/lr (and, with wall_clock_breakdown, its timers) itself; this adds
Train/Samples/train_loss, Train/Samples/eval_loss and Train/Samples/tokens_per_s on the same x axis
(global samples). The monitors write on rank 0 only. Needs the trainer to call on_record after it logs.
"""

from __future__ import annotations

EVENTS = {"train": (("loss", "train_loss"), ("tokens_per_s", "tokens_per_s")),
          "eval": (("eval_loss", "eval_loss"),)}


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
        events += [(f"Train/Samples/{'train_' if kind == 'train' else ''}{key}", value, x)  # a mixture's sources
                   for key, value in record.items() if key.startswith(("loss/", "eval_loss/")) and value is not None]
        if events:
            self.engine.monitor.write_events(events)

    def close(self) -> None:
        return None
