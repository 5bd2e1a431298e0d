"""The asynchronous generator's own process (rl.async, `rl.generator=hf`): a copy of the policy, on CPU or on the
trainer rank's CUDA device (rl.async_generator_device; async_rollouts.generator_device decides), that samples the rollouts of later steps while the trainer rank that started it trains the current one.

It is started by harness/rl/async_rollouts.py (one per trainer rank, forked by multiprocessing's forkserver: a
clean process, not the trainer's) and reads messages
from its pipe in order:
    ("weights", version, [(name, tensor), ...], last)  a bucket of the policy's weights; the last bucket of a sync
                                                       makes `version` the one its next rollouts are tagged with
    ("generate", step, prompt_ids, seed, first_row)    rollouts of that step with the weights it holds now
    ("stop",)
and answers each "generate" with ("rollouts", step, version, completions, sampling_logps, seconds, peak_bytes), the
last its peak CUDA memory so far (0 on CPU), or anything that fails with ("error", text). The weights arrive as CPU
tensors (shared memory) and are copied into the copy's parameters on its device; CUDA is first touched here, in the
forked child, never in the forkserver. Sampling is harness/rl/generation/hf.py's on the copy: row i draws from the stream
(seed, first_row + i), so a rollout depends on its seed, its global row and the weights, not on the process.
"""

from __future__ import annotations

import time
import traceback
from types import SimpleNamespace


def build(model_class, config, dtype, device: str = "cpu"):
    """The policy's architecture on `device` with no weights read from disk (they come from the trainer's first
    sync)."""
    import torch

    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype)
    model.eval()
    return model


def serve(conn, model_class, config, dtype, rl: dict, eos_ids: list[int], pad_id: int, threads: int,
          device: str = "cpu") -> None:
    """The process's main loop (the Process target)."""
    import torch

    torch.set_num_threads(max(int(threads), 1))
    try:
        from harness.rl.generation.hf import HFGenerator

        cuda = device.startswith("cuda")
        if cuda:
            torch.cuda.set_device(torch.device(device))
        model = build(model_class, config, dtype, device)
        params = dict(model.named_parameters())
        tokenizer = SimpleNamespace(eos_token_id=list(eos_ids), pad_token_id=pad_id)
        generator = HFGenerator(rl, SimpleNamespace(module=model), tokenizer, bound_bytes=None)
        version, pending = None, None
        while True:
            message = conn.recv()
            if message[0] == "stop":
                return
            if message[0] == "weights":
                _, new_version, tensors, last = message
                with torch.no_grad():
                    for name, tensor in tensors:
                        params[name].data.copy_(tensor)
                pending = new_version
                if last:
                    version = pending
            elif message[0] == "generate":
                _, step, prompt_ids, seed, first_row = message
                began = time.perf_counter()
                rows = list(range(first_row, first_row + len(prompt_ids)))
                completions = generator.generate(prompt_ids, seed=seed, row_ids=rows)
                logps = generator.last_logps if prompt_ids else []
                peak = torch.cuda.max_memory_allocated() if cuda else 0
                conn.send(("rollouts", step, version, completions, logps, time.perf_counter() - began, peak))
    except (EOFError, KeyboardInterrupt):  # the trainer went away: nothing to answer
        return
    except BaseException:  # noqa: BLE001 - the trainer ends the run with this text
        try:
            conn.send(("error", traceback.format_exc(limit=6)))
        except OSError:
            pass
