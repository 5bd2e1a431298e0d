"""The parity runs' settings (2 ranks, 6 steps of 8 rows, fp32) and what every parity test checks on a
run folder: its losses against a reference, and the planner's bytes against the live engine's."""

from __future__ import annotations

import json

STEPS, SEQ_LEN, MICRO, SEED, LR = 6, 64, 4, 1234, 1e-3
BETAS, EPS, WD, CLIP, EVAL_FRACTION = (0.9, 0.999), 1e-8, 0.01, 1.0, 0.02
def common_args(steps: int, seq_len: int, micro: int, save_every: int) -> list[str]:
    """The --set arguments every parity run shares: AdamW with these betas, eps, weight decay and clipping, no
    scheduler, no eval, a fixed micro-batch with no accumulation."""
    return ["--set", f"train.steps={steps}", "--set", f"train.seq_len={seq_len}", "--set", f"train.save_every={save_every}",
            "--set", "train.eval_every=0", "--set", "scheduler.type=none", "--set", f"optimizer.lr={LR}",
            "--set", f"optimizer.betas={list(BETAS)}", "--set", f"optimizer.eps={EPS}",
            "--set", f"optimizer.weight_decay={WD}", "--set", f"gradient_clipping={CLIP}",
            "--set", f"batch.micro_batch_per_gpu={micro}", "--set", "batch.grad_accum_steps=1",
            "--set", "batch.train_batch_size=\"auto\"", "--set", f"train.eval_fraction={EVAL_FRACTION}"]


COMMON = common_args(STEPS, SEQ_LEN, MICRO, save_every=3) + ["--profile-steps", "2-3"]
STATE_RTOL, COMM_RTOL = 0.02, 0.05

# Working buffers whose split between terms depends on where DeepSpeed parks them (an offloaded fp32
# gradient partition lives inside the pinned CPU buffer, for one): compared as one group.
BUFFER_TERMS = {"fp32_grads", "offload_buffers", "reduce_buckets", "gathered_params", "other"}


def _grouped(states: dict) -> dict[str, int]:
    out: dict[str, int] = {}
    for term, devices in states.items():
        key = "buffers" if term in BUFFER_TERMS else term
        out[key] = out.get(key, 0) + sum(devices.values())
    out["total"] = sum(v for k, v in out.items())
    return out


def assert_planner_matches_engine(run_dir) -> dict:
    """Each rank's planner prediction of its model-state bytes (params, grads, fp32 master, optimizer state,
    buffers, total) and comm bytes per collective vs what the profiling hooks counted on the live engine (each
    rank against its own prediction: pipeline stages hold different layers and neighbours)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    ratios = {}
    for rank, states in enumerate(summary["memory"]["model_states_per_rank"]):
        predicted = _grouped(summary["memory"]["predicted_after_step_per_rank"][rank])
        measured = _grouped(states)
        for term, want in predicted.items():
            got = measured.get(term, 0)
            if want:
                ratios[f"rank{rank}.{term}"] = got / want
                assert abs(got - want) <= STATE_RTOL * want, f"rank {rank} {term}: measured {got} vs planner {want}"
    comm = summary["comm"]
    own = comm.get("predicted_per_rank") or [comm["predicted"]] * len(comm["measured_per_rank"])
    for rank, (measured, predicted) in enumerate(zip(comm["measured_per_rank"], own)):
        for op, want in predicted.items():
            got = measured.get(op, 0)
            if want > 1024:  # scalar all-reduces (overflow, grad norm) are not modelled
                ratios[f"rank{rank}.{op}"] = got / want
                assert abs(got - want) <= COMM_RTOL * want, f"rank {rank} {op}: measured {got} vs planner {want}"
    return ratios


def assert_close(got: dict[int, float], want: list[float], rtol: float) -> float:
    assert sorted(got) == list(range(1, len(want) + 1)), f"steps logged: {sorted(got)}"
    worst = max(abs(got[i + 1] - w) / abs(w) for i, w in enumerate(want))
    assert worst <= rtol, f"largest relative loss difference {worst:.3g} > {rtol}: {got} vs {want}"
    return worst
