"""The reference model of a preference run (train.objective dpo, ipo): what each reference mode costs one rank, in
bytes and time, which layouts a preference objective refuses, and the mode the planner recommends.

Bytes per rank, as harness/train/reference*.py holds them:
- engine: a frozen DeepSpeed engine of the reference in the training precision (lp bytes per weight), with no
  optimizer, so weights only. Under ZeRO-3 it is partitioned like the policy's ZeRO-3 parameters: lp x ceil(P /
  shards) where offload_param puts them (GPU, CPU or NVMe), the tensors under the persistence threshold whole on
  every GPU, and on NVMe the parameter swapper's pinned buffers in host RAM. In stages 0-2 it is a whole copy per
  rank on the GPU: lp x P. The reference has no LoRA adapters: P is the base model's count.
- precomputed: a float64 [pairs, 2] table (each pair's chosen and rejected summed log-probs, by pair id; train and
  eval pairs) in every rank's host RAM: 16 bytes per pair per rank (two float64; harness/train/reference_cache.py).
- adapter: nothing (the policy's own base with the LoRA adapters switched off).

Time: engine and adapter run one more forward of the 2B rows per micro-step (no backward: about a third of a
forward and backward's compute; under ZeRO-3 one more all-gather of the weights, which the forward hides where the
hardware overlaps). precomputed runs one forward over every pair once before training, sharded over all ranks, and
none during training: a one-off cost, reported beside the step time.

The recommendation (recommend): no reference for simpo and orpo; under LoRA with no other reference, adapter (no
bytes, nothing up front); otherwise precomputed when the run trains on at least as many pairs as the set holds (the
pass costs no more forwards than the engine would run; steps not given: assumed so) and its table fits in host
RAM; else engine when its weights fit beside the policy; else precomputed.

Online RL (train.objective grpo, planner field "rollouts"): no reference when rl.beta is 0 (TRL loads none, no KL
term); else adapter under LoRA, an engine otherwise (harness/config/rl_rules.reference_mode); precomputed is not
applicable (the completions are generated during training: nothing to score before it).
"""

from __future__ import annotations

from harness.config.defaults import PRECISION_BYTES, REFERENCE_FREE
from harness.planner.inputs import Cluster, Workload

MODES = ("precomputed", "engine", "adapter")
PRECOMPUTED_BYTES_PER_PAIR = 16  # float64 (chosen, rejected) per pair, on every rank's host
DEVICES = ("gpu", "cpu", "nvme")


def refused(c, objective: str) -> str | None:
    """Why a layout cannot train an objective other than lm (preference_rules.py, rl_rules.py and the distillation
    rules refuse it too)."""
    why = [(c.pp > 1, "pipeline: the objective's loss would have to run inside the last stage's schedule"),
           (c.tp > 1, "tensor parallel: the head's logits are split by vocabulary"),
           (c.sp > 1, "sequence parallel: each rank holds a slice of every row"),
           (c.tiled, "tiled loss: the objective's loss computes its own log-probs (row by row or in chunks)")]
    reasons = [text for hit, text in why if hit]
    return f"objective {objective} refuses {'; '.join(reasons)}" if reasons else None


def engine_bytes(base_params: int, *, stage: int, offload_param: str, zero_shards: int, precision: str,
                 persistent: int = 0, swap_buffer_bytes: int = 0) -> dict[str, int]:
    """A frozen reference engine's weights on one rank, by device (see the module doc)."""
    lp, out = PRECISION_BYTES[precision], dict.fromkeys(DEVICES, 0)
    if stage != 3:
        out["gpu"] = lp * base_params
        return out
    device = "gpu" if offload_param == "none" else offload_param
    out[device] += lp * -(-base_params // zero_shards)
    out["gpu"] += lp * persistent
    if offload_param == "nvme":
        out["cpu"] += swap_buffer_bytes
    return out


def precomputed_bytes(pairs: int | None) -> dict[str, int]:
    """The precomputed table on one rank's host (pairs None: not known, counted as none)."""
    return {"gpu": 0, "cpu": PRECOMPUTED_BYTES_PER_PAIR * (pairs or 0), "nvme": 0}


def pairs_trained(work: Workload) -> int | None:
    """Pairs the run trains (optimizer steps x pairs per step), None when the steps or the batch are not known."""
    if work.steps is None or work.global_batch is None:
        return None
    return work.steps * work.global_batch


def recommend(objective: str, lora: bool, work: Workload, fits: dict[str, bool]) -> tuple[str | None, str]:
    """(the mode to use, why) by the rule in the module doc."""
    if objective in REFERENCE_FREE:
        return None, f"{objective} has no reference model"
    if work.terms == "rollouts" and not work.beta:
        return None, "beta 0: TRL loads none, no KL term; --beta > 0 adds one"
    if lora:
        return "adapter", "LoRA: the base with the adapters off is the reference (no bytes, nothing up front)"
    if work.terms == "rollouts":
        return "engine", ("the completions are generated during training, so no pass before it can score them: "
                          "a frozen engine")
    trained = pairs_trained(work)
    once = work.pairs is None or trained is None or work.pairs <= trained
    if once and fits["precomputed"]:
        return "precomputed", ("the run trains every pair at least once, so one pass up front costs no more "
                               "forwards than a reference engine, and needs no GPU memory")
    if fits["engine"]:
        return "engine", (f"the run trains {trained:,} of {work.pairs:,} pairs: a forward per micro-step costs "
                          "less than a pass over the whole set" if not once else
                          "the precomputed table does not fit in host RAM")
    return "precomputed", "a reference engine does not fit beside the policy"


def pass_s(rows_work: Workload, world: int, forward_s: float) -> float | None:
    """precomputed: seconds of the one forward over every pair before training, sharded over all ranks in
    micro-batches of the run's size (rows_work: the step time's workload, whose micro-batch counts sequences;
    forward_s: one micro-batch's forward); None when the set's size is not given."""
    if not rows_work.pairs:
        return None
    pairs_per_micro = rows_work.micro_batch / rows_work.rows_per_item
    return -(-rows_work.pairs // int(world * pairs_per_micro)) * forward_s


def fits_beside(mem: dict, extra: dict[str, int], cluster: Cluster) -> bool:
    """Whether the layout's memory with `extra` bytes per rank (a reference's, a teacher's) still fits the GPU, CPU and
    NVMe."""
    gpn = cluster.gpus_per_node
    if mem["gpu_bytes"] + extra["gpu"] > cluster.usable_gpu_bytes:
        return False
    cpu, nvme = mem["cpu_bytes_per_node"] + gpn * extra["cpu"], mem["nvme_bytes_per_node"] + gpn * extra["nvme"]
    if cluster.usable_cpu_bytes is not None and cpu > cluster.usable_cpu_bytes:
        return False
    return not nvme or (cluster.usable_nvme_bytes is not None and nvme <= cluster.usable_nvme_bytes)


def attach(result: dict, c, count, cluster: Cluster, work: Workload, persistent: int, swap_buffer_bytes: int) -> None:
    """Add the reference to one evaluated layout: every mode's bytes per rank and whether the layout fits with it,
    the mode used (work.reference_mode, else the recommended one), and that mode's bytes in the memory totals."""
    lora = bool(count.lora_per_layer)
    base = count.total - count.num_layers * count.lora_per_layer
    mem, gpn = result["memory"], cluster.gpus_per_node
    modes = {"precomputed": precomputed_bytes(work.pairs),
             "engine": engine_bytes(base, stage=c.stage, offload_param=c.offload_param,
                                    zero_shards=result["dp"], precision=work.precision, persistent=persistent,
                                    swap_buffer_bytes=swap_buffer_bytes),
             "adapter": dict.fromkeys(DEVICES, 0)}
    applicable = {"precomputed": work.terms == "pairs", "engine": True, "adapter": lora}
    fits = {m: fits_beside(mem, b, cluster) and applicable[m] for m, b in modes.items()}
    best, why = recommend(work.objective, lora, work, fits)
    mode = work.reference_mode or best
    if best is None:  # no reference at all: reference-free, or RL with beta 0
        mode, modes = None, {}
    used = modes.get(mode, dict.fromkeys(DEVICES, 0))
    for key in ("gpu_bytes", "gpu_backward_bytes", "gpu_step_bytes"):
        mem[key] += used["gpu"]
    mem["cpu_bytes_per_rank"] += used["cpu"]
    mem["cpu_bytes_per_node"] += gpn * used["cpu"]
    mem["nvme_bytes_per_node"] += gpn * used["nvme"]
    mem["reference"] = {"objective": work.objective, "mode": mode, "recommended": best, "why": why,
                        "pairs": work.pairs, "bytes_per_pair": PRECOMPUTED_BYTES_PER_PAIR, "base_params": base,
                        "modes": {m: {**b, "fits": fits[m], "applicable": applicable[m]}
                                  for m, b in modes.items()}}
