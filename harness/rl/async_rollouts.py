"""rl.async: each trainer rank's generator process (harness/rl/generation/worker.py), fed the policy's weights and
the prompts of the steps ahead, so the rollouts of step k + 1.. are sampled while step k trains.

The schedule is fixed by the step numbers alone (the same on every rank, and from run to run):
- weights: the policy after step k is version k + 1 (the starting weights: the start step's version); it is sent
  after every rl.weight_sync_steps-th step, bucket by bucket (rl.sync_bucket_mb of gathered bytes, as the colocated
  vLLM sync walks them: under ZeRO-3 every rank gathers each bucket collectively, then sends its copy);
- requests: once version v is sent, the rollouts of every step up to v + rl.max_staleness are asked for, in order;
  the process answers them in order with the weights it holds when it reaches each one, so the rollouts of step j
  carry version v(j) >= j - max_staleness (TRL's `model_version`, in rollouts.jsonl);
- a step whose rollouts were never asked for (its would-be version too old: weight_sync_steps > max_staleness + 1)
  sends the current weights first, out of turn; rollouts that come back older than max_staleness all the same are
  dropped, counted (TRL's sample/dropped_stale_total) and asked for again on fresh weights.
max_staleness 0 is the synchronous run: the weights of step k are sent before its rollouts are asked for.

Where the process holds its copy (rl.async_generator_device, generator_device below): auto follows the trainer
rank's engine, on its own CUDA device when it trains on CUDA (the weights and the KV cache there; CUDA is initialised
in the forked child only, never in the forkserver, which imports torch without touching CUDA), else on CPU.

A generator process that dies, answers with an error, or is silent past rl.async_timeout_s ends the run: the rank
says so in the step's gather of rollouts (harness/train/grpo.py), and every rank raises GeneratorFailed with the
same reason (exit 1). It is not restarted.
"""

from __future__ import annotations

import time

import torch

from harness.errors import GeneratorFailed
from harness.rl.generation.gather import gathered_bytes, is_zero3
from harness.rl.generation.vllm import bucket_params, buckets, merged, named_weights

MIB = 1 << 20
PEFT_PREFIX = "base_model.model."
POLL_S = 0.2
PRELOAD = ("torch", "transformers", "harness.rl.generation.worker", "harness.rl.generation.hf")


def generator_device(choice: str, trainer_device) -> str:
    """The device of a generator process's copy for rl.async_generator_device `choice` (auto | cpu | cuda) and the
    trainer rank's engine device: cpu, or the trainer's own CUDA device ("cuda:i"; the GPU it shares with training,
    which harness plan --async prices). cuda on a trainer not on CUDA is refused before launch
    (async_device_problem); here it raises."""
    from harness.planner.rl import async_device

    device = torch.device(trainer_device)
    if async_device(choice, device.type) == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"rl.async_generator_device {choice}: the trainer rank runs on {device}, not CUDA")
    return f"cuda:{device.index if device.index is not None else torch.cuda.current_device()}"


def async_device_problem(rl: dict, cuda: bool) -> str | None:
    """Why rl.async_generator_device cuda cannot run on this machine (`cuda`: whether the ranks train on CUDA), or
    None."""
    if not rl.get("async") or rl.get("async_generator_device", "auto") != "cuda" or cuda:
        return None
    return ("rl.async_generator_device cuda: the generator processes would hold their copy of the policy on the "
            "trainer rank's CUDA device, and the ranks here do not train on CUDA (no CUDA device, or DeepSpeed's "
            "accelerator is not cuda)")


def base_model(module):
    return module.get_base_model() if hasattr(module, "get_base_model") else module


class AsyncGeneration:
    """One rank's generator process and its schedule. request(step) -> (prompt_ids, seed, first_row) of this rank's
    rows of that step."""

    def __init__(self, rl: dict, engine, tokenizer, request, *, rank: int, last_step: int):
        self.rl, self.engine, self.request, self.rank = rl, engine, request, rank
        self.staleness, self.every = int(rl["max_staleness"]), int(rl["weight_sync_steps"])
        self.timeout_s, self.last_step = float(rl["async_timeout_s"]), last_step
        self.bucket_bytes = int(float(rl["sync_bucket_mb"]) * MIB)
        self.synced = None  # the version last sent
        self.asked = -1  # the last step whose rollouts were asked for
        self.results: dict[int, tuple] = {}
        self.failure: str | None = None
        self.dropped = 0
        self.last_sync = {"seconds": 0.0, "bytes": 0, "buckets": 0}
        self.device = generator_device(rl.get("async_generator_device", "auto"), engine.device)
        self.proc, self.conn = self._start(tokenizer)

    def _start(self, tokenizer):
        import torch.multiprocessing as mp

        from harness.rl.generation import worker

        base = base_model(self.engine.module)
        eos = tokenizer.eos_token_id
        eos_ids = list(eos) if isinstance(eos, list) else [eos]
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos_ids)
        ctx = mp.get_context("forkserver")  # one clean server per trainer process forks the generators: the
        ctx.set_forkserver_preload(list(PRELOAD))  # imports are paid once, not per run of a process (tests' jobs)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker.serve, name=f"harness-generator-rank{self.rank}", daemon=True,
                           args=(child, type(base), base.config, next(base.parameters()).dtype, dict(self.rl),
                                 eos_ids, pad, torch.get_num_threads(), self.device))
        proc.start()
        child.close()
        return proc, parent

    # --- the schedule ---
    def start(self, step0: int) -> None:
        self.sync(step0)
        self.ask_ahead()

    def after_step(self, step: int) -> None:
        """After optimizer step `step` (from 0): version step + 1 exists; sent every weight_sync_steps. After the
        run's last step the process stops."""
        if step >= self.last_step:
            self.close()
        elif (step + 1) % self.every == 0:
            self.sync(step + 1)
            self.ask_ahead()

    def ask_ahead(self) -> None:
        while self.asked < min(self.synced + self.staleness, self.last_step):
            self.ask(self.asked + 1)

    def ask(self, step: int) -> None:
        prompt_ids, seed, first_row = self.request(step)
        self._send(("generate", step, prompt_ids, seed, first_row))
        self.asked = max(self.asked, step)

    def take(self, step: int) -> dict:
        """Step `step`'s rollouts on this rank: {completions, sampling_logps, version, seconds, peak_bytes (the
        process's peak CUDA memory so far; 0 on CPU)} or {error}."""
        if self.asked < step:  # its version would be too old: the current weights, out of turn
            self.sync(step)
            self.ask(step)
        got = self._wait(step)
        while self.failure is None and step - got[0] > self.staleness:
            self.dropped += 1
            self.sync(step)
            self.ask(step)
            got = self._wait(step)
        if self.failure is not None:
            return {"error": self.failure}
        version, completions, logps, seconds, peak = got
        return {"completions": completions, "sampling_logps": logps, "version": version, "seconds": seconds,
                "peak_bytes": peak}

    # --- weights and messages ---
    @torch.no_grad()
    def sync(self, version: int) -> None:
        """The policy's weights to the process in buckets (collective under ZeRO-3: every rank walks them, and keeps
        walking after its own process failed so the others' gathers complete)."""
        import deepspeed

        began, module = time.perf_counter(), self.engine.module
        groups = buckets(list(named_weights(module)), self.bucket_bytes)
        sent = 0
        for i, bucket in enumerate(groups):
            params = bucket_params(bucket)
            with deepspeed.zero.GatheredParameters(params, enabled=is_zero3(module)):
                tensors = [(n.removeprefix(PEFT_PREFIX), merged(w, lora).detach().to("cpu", copy=True))
                           for n, w, lora in bucket]
            self._send(("weights", version, tensors, i == len(groups) - 1))
            sent += sum(map(gathered_bytes, params))
        self.synced = version
        self.last_sync = {"seconds": time.perf_counter() - began, "bytes": sent, "buckets": len(groups)}

    def _send(self, message) -> None:
        if self.failure is not None:
            return
        try:
            self.conn.send(message)
        except OSError as e:  # it died: say how (the exit code), not only that the pipe broke
            self.proc.join(timeout=5)
            self._fail(f"{ended(self.proc.exitcode)}; sending to it raised {type(e).__name__}: {e}")

    def _wait(self, step: int) -> tuple:
        """(version, completions, logps, seconds, peak_bytes) of step `step`, reading the answers in order."""
        deadline = time.monotonic() + self.timeout_s
        while self.failure is None and step not in self.results:
            if self.conn.poll(POLL_S):
                try:
                    message = self.conn.recv()
                except (EOFError, OSError):
                    self.proc.join(timeout=5)
                    self._fail(ended(self.proc.exitcode))
                    break
                if message[0] == "error":
                    self._fail("it raised:\n" + message[1].rstrip())
                else:
                    self.results[message[1]] = tuple(message[2:])
            elif not self.proc.is_alive():
                self._fail(ended(self.proc.exitcode))
            elif time.monotonic() > deadline:
                self._fail(f"no rollouts for step {step + 1} within rl.async_timeout_s = {self.timeout_s:g} s")
        return self.results.pop(step, (step, [], [], 0.0, 0))

    def _fail(self, why: str) -> None:
        self.failure = (f"rank {self.rank}: rl.async's generator process (pid {self.proc.pid}) failed: {why}\n"
                        "    fix: see the reason above (a process killed by the OS for memory: lower "
                        "rl.max_staleness or the batch); the run is not restarted, resume it from its last "
                        "checkpoint")

    def close(self) -> None:
        """Stop the process (also on the run's failure; a run that ends otherwise early leaves it to end with the
        trainer's process: its pipe closes)."""
        if self.conn.closed:
            return
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(timeout=5)
            if self.proc.is_alive():
                self.proc.kill()
        self.conn.close()


def ended(code: int | None) -> str:
    """How the process ended, in words (a negative exit code is the signal that killed it)."""
    if code is None:
        return "its pipe closed while it still runs"
    if code < 0:
        import signal

        return f"it exited with code {code} (killed by {signal.Signals(-code).name})"
    return f"it exited with code {code}"


def raise_if_failed(outcomes: list, rank: int, generation: AsyncGeneration) -> None:
    """Every rank's outcome of the step's generation, gathered: every rank stops its generator process and raises
    GeneratorFailed (harness/train/job.py: rank 0 says it, exit code 1); the other ranks print it here."""
    failures = [o for o in outcomes if o]
    if failures:
        import sys

        generation.close()
        if rank:
            print(f"error (rank {rank}): " + "\n".join(failures), file=sys.stderr, flush=True)
        raise GeneratorFailed("\n".join(failures))
