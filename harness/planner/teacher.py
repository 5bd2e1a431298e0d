"""The teacher of a distillation run (train.objective gkd, distill; registry planner field "distill"): what each
teacher mode costs one rank, in bytes and time, which modes the run refuses, and the mode the planner recommends.

Bytes per rank, weights (as harness/train/reference_engine.py holds a frozen model; the teacher uses that machinery):
- engine: a frozen DeepSpeed engine of the teacher with no optimizer, in the training precision. Where the student
  is ZeRO-3 it is partitioned like the student's parameters, with the student's ZeRO-3 keys (its persistence
  threshold, its offload_param): lp x ceil(P_t / shards) where offload_param puts them, the tensors at or under the
  threshold whole on every GPU (planner/reference.engine_bytes). Stages 0-2 hold whole weights: lp x P_t per GPU.
- adapter: nothing beyond the base (under LoRA the student's own base with the adapters off: self-distillation).
- precomputed: nothing on the GPU or in rank RAM (the store is memory-mapped). On disk (the store's files, docs/
  distillation.md): loss tokens x (k x (id + 4 B float32 log-prob) + 4 B, the actual token's log-prob) + 8 B per row
  of the row index (records + 1), ids uint16 for a vocabulary of at most 65,536 tokens, else uint32; loss tokens at
  most records x completion_len. The tail mass is derived at load, not stored.
- served: nothing here; the endpoint holds lp x P_t (shown as the endpoint's).
The targets one micro-batch hands the loss (on the GPU during the step): engine and adapter the teacher's logits,
tokens x V x lp; precomputed and served the top-k, tokens x (k x (8 B int64 id + 4 B float32 log-prob) + 4 B, the
actual token's log-prob).

Time per optimizer step: engine one teacher forward per micro-step (no backward), the student's forward time x
P_t / P_s (the FLOPs scale with the parameters); adapter the student's forward once more; precomputed and served
none here. precomputed runs one teacher forward over every record before training, sharded over all ranks:
2 x P_t x records x (prompt + completion) FLOPs / (ranks x the profile's achieved FLOP/s).

Refused (the run refuses them too; docs/planner.md, "Distillation"): adapter without LoRA or with another model as the
teacher; precomputed with on-policy completions (nothing to score before training); served with beta > 0 and k > 1
(the endpoint returns the teacher's top-k, the loss would need its values at the student's top-k).

The recommendation (recommend): adapter when the teacher is the student's own base under LoRA; otherwise engine when
its weights fit beside the student (the exact full-vocabulary loss, no pass up front); else precomputed when the
completions are the dataset's (only a pass up front needs the teacher, not a GPU beside the student). served is
never picked for the user: its endpoint needs GPUs outside the cluster planned; where nothing else fits, the layout
does not fit, and the reason names --teacher-mode served.
"""

from __future__ import annotations

from harness.config.defaults import PRECISION_BYTES
from harness.config.run_model import Completions
from harness.planner import hardware
from harness.planner.inputs import Cluster, TeacherLoad, Workload
from harness.planner.reference import DEVICES, engine_bytes, fits_beside

MODES = ("engine", "adapter", "precomputed", "served")
LOGPROB_BYTES = 4  # float32: each top-k entry's log-prob and the actual token's, on disk and handed to the loss
ROW_INDEX_BYTES = 8  # uint64 per row (and one more): where each row's loss tokens start in the store
TARGET_ID_BYTES = 8  # the top-k ids handed to the loss: int64 (torch.gather's index)


def id_bytes(vocab_size: int) -> int:
    """The store's id width: uint16 while the vocabulary fits it, else uint32."""
    return 2 if vocab_size <= 1 << 16 else 4


def teacher_load(name: str, cfg: dict, student_cfg: dict, *, is_student: bool, beta: float, chunk_tokens: int,
                 mode: str | None = None, top_k: int = 1, on_policy: bool = False, lmbda: float = 0.0,
                 records: int | None = None, threshold: int | None = None) -> TeacherLoad:
    """The teacher from its config dict; the tensors it keeps whole under ZeRO-3 are those at or under the
    student's persistence threshold (the teacher engine takes the student's ZeRO-3 keys): `threshold`, else the one
    the harness's recipes size from the student's width."""
    from harness.planner.memory import harness_buckets
    from harness.planner.params import count_params

    count = count_params(cfg)
    if threshold is None:
        hidden = int(student_cfg.get("hidden_size") or student_cfg.get("n_embd"))
        threshold = harness_buckets(hidden).param_persistence_threshold
    return TeacherLoad(name, count.total, count.persistent_numel(threshold), count.largest_tensor or 0,
                       int(cfg["vocab_size"]), is_student, beta, chunk_tokens, mode, top_k, on_policy, lmbda, records)


def of_run(c: Completions, student: str, student_cfg: dict, threshold: int | None = None) -> TeacherLoad | None:
    """A distillation run's teacher (config/run_model.Completions) as the planner prices it; None when its config
    cannot be read here (a hub id not built in: the plan then leaves the teacher out)."""
    from harness.errors import UsageError
    from harness.model_shapes import load_model_config

    try:
        cfg = load_model_config(c.teacher)
    except UsageError:
        return None
    return teacher_load(c.teacher, cfg, student_cfg, is_student=c.teacher == student, beta=c.beta,
                        chunk_tokens=c.chunk_tokens, mode=c.teacher_mode, top_k=c.top_k, on_policy=c.on_policy,
                        lmbda=c.lmbda, threshold=threshold)


def refused(t: TeacherLoad, *, lora: bool) -> dict[str, str | None]:
    """Why each mode cannot teach this run (None: it can)."""
    adapter = None
    if not lora or not t.is_student:
        adapter = ("the adapter teacher is the student's own base with the adapters off: it needs LoRA (--lora-r) "
                   "and no other --teacher")
    return {"engine": None, "adapter": adapter,
            "precomputed": "the completions are generated during training (on-policy), so there is nothing to score "
                           "before it" if t.on_policy else None,
            "served": "the endpoint returns the teacher's top-k log-probs; with beta > 0 and k > 1 the loss needs its "
                      "values at the student's top-k, which it never sees" if t.beta > 0 and t.top_k > 1 else None}


def store_bytes(t: TeacherLoad, completion_len: int) -> int | None:
    """The precomputed store on disk (the module doc's formula); None when the records are unknown."""
    if t.records is None:
        return None
    per_token = t.top_k * (id_bytes(t.vocab_size) + LOGPROB_BYTES) + LOGPROB_BYTES
    return t.records * completion_len * per_token + (t.records + 1) * ROW_INDEX_BYTES


def targets_bytes(mode: str, t: TeacherLoad, tokens: int, lp: int) -> int:
    """What the teacher hands the loss for one micro-batch: its logits, or its top-k ids and log-probs."""
    if mode in ("engine", "adapter"):
        return tokens * t.vocab_size * lp
    return tokens * (t.top_k * (TARGET_ID_BYTES + LOGPROB_BYTES) + LOGPROB_BYTES)


def recommend(t: TeacherLoad, usable: dict[str, bool]) -> tuple[str | None, str]:
    """(the mode to use, why) by the rule in the module doc; usable: applicable and fits, per mode."""
    if usable["adapter"]:
        return "adapter", "LoRA on the teacher's own weights: the base with the adapters off (no copy, no pass)"
    if usable["engine"]:
        return "engine", ("its weights fit beside the student: the exact full-vocabulary loss, nothing computed up "
                          "front")
    if usable["precomputed"]:
        return "precomputed", ("an engine does not fit beside the student and the completions are the dataset's: "
                               "one teacher pass before training writes the top-k store")
    return None, ("its engine does not fit beside the student here" + (" and the completions are generated in the "
                  "loop (nothing to precompute)" if t.on_policy else "") + ": ZeRO-3 shards it, or --teacher-mode "
                  "served puts it on an endpoint's GPUs (vLLM)")


def attach(result: dict, c, lora: bool, cluster: Cluster, work: Workload, swap_buffer_bytes: int) -> None:
    """Add the teacher to one evaluated layout: every mode's bytes per rank (weights and targets), whether the layout
    fits with it, the mode used (the teacher's own, else the recommended one), and that mode's bytes in the totals."""
    t, mem, lp = work.teacher, result["memory"], PRECISION_BYTES[work.precision]
    tokens = mem["activations"]["tokens_per_rank"]
    weights = {"engine": engine_bytes(t.params, stage=c.stage, offload_param=c.offload_param,
                                      zero_shards=result["dp"], precision=work.precision, persistent=t.persistent,
                                      swap_buffer_bytes=swap_buffer_bytes),
               **{m: dict.fromkeys(DEVICES, 0) for m in ("adapter", "precomputed", "served")}}
    why_not = refused(t, lora=lora)
    modes = {}
    for m, w in weights.items():
        used = {**w, "gpu": w["gpu"] + targets_bytes(m, t, tokens, lp)}
        modes[m] = {**used, "weights_gpu": w["gpu"], "targets": targets_bytes(m, t, tokens, lp),
                    "fits": fits_beside(mem, used, cluster), "applicable": why_not[m] is None, "why_not": why_not[m]}
    modes["served"]["endpoint_bytes"] = lp * t.params
    modes["precomputed"]["disk_bytes"] = store_bytes(t, work.completion_len or work.seq_len)
    best, why = recommend(t, {m: v["fits"] and v["applicable"] for m, v in modes.items()})
    mode = t.mode or best
    used = modes.get(mode, dict.fromkeys(DEVICES, 0))
    for key in ("gpu_bytes", "gpu_backward_bytes", "gpu_step_bytes"):
        mem[key] += used["gpu"]
    mem["cpu_bytes_per_rank"] += used["cpu"]
    mem["cpu_bytes_per_node"] += cluster.gpus_per_node * used["cpu"]
    mem["nvme_bytes_per_node"] += cluster.gpus_per_node * used["nvme"]
    mem["teacher"] = {"objective": work.objective, "name": t.name, "params": t.params, "mode": mode,
                      "recommended": best, "why": why, "top_k": t.top_k, "on_policy": t.on_policy, "lmbda": t.lmbda,
                      "records": t.records, "modes": modes}


def step_s(result: dict, micro_batches: int, forward_s: float, student_params: int) -> dict[str, float]:
    """The teacher's seconds per optimizer step in the mode used (engine: its forward scaled by P_t / P_s)."""
    teacher = result["memory"].get("teacher") or {}
    if teacher.get("mode") == "engine":
        return {"teacher_s": micro_batches * forward_s * teacher["params"] / max(student_params, 1)}
    if teacher.get("mode") == "adapter":
        return {"teacher_s": micro_batches * forward_s}
    return {}


def pass_s(work: Workload, world: int, profile: dict) -> float | None:
    """precomputed: seconds of the teacher's one forward over every record before training, on all ranks."""
    t = work.teacher
    if t is None or not t.records:
        return None
    return 2.0 * t.params * t.records * work.seq_len / (world * hardware.achieved_flops(profile, work.precision))
