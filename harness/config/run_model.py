"""The run as one typed, frozen value: which model, on how many ranks split how, with which ZeRO settings, batch,
precision and sequence handling.

Built once per launch from the resolved recipe and DeepSpeed dict (`RunModel.from_resolved`), after every "auto"
is filled. The planner takes the same value (`harness plan`, `--recipe auto` and the run's own prediction all
evaluate a RunModel), so a fact the run trains with and the fact the planner prices are one field, read once.

Degrees have one meaning each (Degrees): `dp` is the number of data-parallel replicas (each reads its own
micro-batches); ZeRO partitions over `zero_shards` = dp x sp ranks (a sequence-parallel group shares one
replica's batch but shards its states); AutoEP experts over `expert_shards` = zero_shards / ep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from harness.config import defaults as dd
from harness.config.defaults import STAGE3_MAX_LIVE_PARAMETERS, TILE_TOKENS
from harness.config.preference_rules import is_preference, objective, packing, reference_mode
from harness.config.resolve import degrees as pipe_tensor_degrees
from harness.config.resolve import sequence_parallel


@dataclass(frozen=True)
class ZeroBuckets:
    """ZeRO buffer sizes in elements. Defaults are DeepSpeed 0.19.8's (what a DeepSpeed dict without the key gets)."""

    reduce_bucket_elems: int = dd.REDUCE_BUCKET_ELEMS
    prefetch_bucket_elems: int = dd.PREFETCH_BUCKET_ELEMS
    param_persistence_threshold: int = dd.PARAM_PERSISTENCE_THRESHOLD
    sub_group_elems: int = dd.SUB_GROUP_ELEMS
    overlap_comm: bool | None = None  # None: DeepSpeed's default (on for stage 3 only)
    optimizer_swap_buffer_count: int = dd.OPTIMIZER_SWAP_BUFFER_COUNT  # offload_optimizer.buffer_count
    param_swap_buffer_count: int = dd.PARAM_SWAP_BUFFER_COUNT  # offload_param.buffer_count
    param_swap_buffer_elems: int = dd.PARAM_SWAP_BUFFER_ELEMS  # offload_param.buffer_size
    max_reuse_distance_elems: int = dd.MAX_REUSE_DISTANCE_ELEMS  # stage3_max_reuse_distance

    @classmethod
    def of(cls, zo: Mapping) -> "ZeroBuckets":
        """The buckets a resolved zero_optimization block configures (DeepSpeed's default where a key is absent)."""
        d = cls()
        opt, par = zo.get("offload_optimizer") or {}, zo.get("offload_param") or {}
        return cls(reduce_bucket_elems=int(zo.get("reduce_bucket_size", d.reduce_bucket_elems)),
                   prefetch_bucket_elems=int(zo.get("stage3_prefetch_bucket_size", d.prefetch_bucket_elems)),
                   param_persistence_threshold=int(zo.get("stage3_param_persistence_threshold",
                                                          d.param_persistence_threshold)),
                   sub_group_elems=int(zo.get("sub_group_size", d.sub_group_elems)),
                   overlap_comm=zo.get("overlap_comm"),
                   optimizer_swap_buffer_count=int(opt.get("buffer_count", d.optimizer_swap_buffer_count)),
                   param_swap_buffer_count=int(par.get("buffer_count", d.param_swap_buffer_count)),
                   param_swap_buffer_elems=int(par.get("buffer_size", d.param_swap_buffer_elems)),
                   max_reuse_distance_elems=int(zo.get("stage3_max_reuse_distance", d.max_reuse_distance_elems)))


@dataclass(frozen=True)
class Degrees:
    """How the world is split. world = tp x pp x sp x dp; ep splits the experts inside the ZeRO group."""

    world: int
    tp: int = 1
    pp: int = 1
    sp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.world % (self.tp * self.pp * self.sp):
            raise ValueError(f"tp({self.tp}) x pp({self.pp}) x sp({self.sp}) does not divide world({self.world})")

    @property
    def dp(self) -> int:
        """Data-parallel replicas: each trains its own micro-batches."""
        return self.world // (self.tp * self.pp * self.sp)

    @property
    def zero_shards(self) -> int:
        """Ranks one ZeRO partition spans: the replicas and, inside each, its sequence-parallel ranks."""
        return self.dp * self.sp

    @property
    def expert_shards(self) -> int:
        """Ranks one AutoEP expert's states shard over (expert-data-parallel group)."""
        return max(1, self.zero_shards // self.ep)


@dataclass(frozen=True)
class Zero:
    stage: int = 0
    offload_optimizer: str = "none"  # none | cpu | nvme, as the DeepSpeed dict says
    offload_param: str = "none"  # ZeRO-3 only
    buckets: ZeroBuckets = field(default_factory=ZeroBuckets)
    max_live_params: int = STAGE3_MAX_LIVE_PARAMETERS

    @classmethod
    def of(cls, ds: Mapping) -> "Zero":
        zo = ds.get("zero_optimization", {}) or {}
        stage = int(zo.get("stage", 0))
        opt = (zo.get("offload_optimizer") or {}).get("device", "none") if stage >= 1 else "none"
        par = (zo.get("offload_param") or {}).get("device", "none") if stage == 3 else "none"
        return cls(stage, opt or "none", par or "none", ZeroBuckets.of(zo),
                   int(zo.get("stage3_max_live_parameters", STAGE3_MAX_LIVE_PARAMETERS)))


@dataclass(frozen=True)
class Batch:
    micro_batch: int  # sequences per rank per micro-step (train_micro_batch_size_per_gpu)
    grad_accum: int  # micro-steps per optimizer step (a pipeline's micro-batches)
    global_batch: int  # sequences per optimizer step over all replicas


@dataclass(frozen=True)
class Sequence:
    """How one sequence is handled: its length, packing, the attention the recipe asks for, long-context tiling and
    activation checkpointing/offload."""

    seq_len: int
    packing: str = "document"  # document (position ids restart per document) | concat
    attention: str = "auto"  # the recipe's train.attention
    tiled_mlp: bool = False
    tiled_loss: bool = False
    tile_tokens: int = TILE_TOKENS
    activation_checkpointing: bool = False
    activation_offload: bool = False


@dataclass(frozen=True)
class Adapter:
    """LoRA (peft): only the adapters train."""

    r: int
    target_modules: tuple[str, ...]


@dataclass(frozen=True)
class Preference:
    """A preference objective (train.objective dpo, ipo, simpo, orpo): a micro-batch of B pairs is 2B sequences.
    reference_mode is resolved (config/preference_rules.reference_mode): precomputed | engine | adapter, None for
    simpo and orpo (no reference)."""

    objective: str
    reference_mode: str | None
    beta: float
    reference: str | None = None  # preference.reference: a model folder or hub id; None: the policy's start


@dataclass(frozen=True)
class Completions:
    """An objective whose batch items are completions (the registry's planner field rollouts or distill), as the
    planner prices it (planner/rank.workload): grpo's rows are the rl block's prompt + completion, with a reference
    only when beta > 0; a distillation run's rows are train.seq_len's records, its teacher priced in its mode."""

    objective: str
    prompt_len: int | None = None  # grpo: rl.max_prompt_length (None: the rows are train.seq_len's)
    completion_len: int | None = None
    beta: float = 0.0  # rl.beta (0: no reference), or distill's resolved beta
    reference_mode: str | None = None  # grpo: engine | adapter, None without a reference
    teacher: str | None = None  # distill: the teacher's model (the student's own when none is named)
    teacher_mode: str | None = None  # distill: engine | adapter | precomputed | served
    on_policy: bool = False
    lmbda: float = 0.0
    chunk_tokens: int = 0  # distill.loss_chunk_tokens
    top_k: int = 1  # distill.loss_top_k (precomputed, served)


# fp32 tensors an optimizer keeps per trainable element, by the DeepSpeed dict's optimizer.type (lower case).
# The Adam family's two moments when the type is absent or unknown (the planner's assumption).
_STATES_BY_OPTIMIZER = {"adagrad": 1, "lion": 1, "sgd": None, "musgd": None}  # None: 1 with momentum, else 0
ADAM_STATES = 2  # exp_avg and exp_avg_sq


def optimizer_states(ds: Mapping) -> int:
    """fp32 state tensors per trainable element of the DeepSpeed dict's optimizer: Adam, AdamW, Lamb 2 (exp_avg,
    exp_avg_sq); Lion, Adagrad 1; SGD 1 with momentum, 0 without (torch keeps no state then)."""
    opt = ds.get("optimizer") or {}
    kind = str(opt.get("type", "adam")).lower()
    states = _STATES_BY_OPTIMIZER.get(kind, ADAM_STATES)
    if states is None:
        return 1 if float((opt.get("params") or {}).get("momentum", 0) or 0) else 0
    return states


@dataclass(frozen=True)
class OptimizerDtypes:
    """How wide the optimizer's tensors are, as the DeepSpeed dict says: bytes per element of the master copy (and
    the gradient partition it steps on; bf16.bf16_master_weights_and_grads) and of each optimizer state
    (bf16.bf16_optimizer_states); muon: DeepSpeed's Muon (one momentum on the matrices, AdamW on the rest)."""

    master_bytes: int = 4
    state_bytes: int = 4
    muon: bool = False

    @classmethod
    def of(cls, ds: Mapping) -> "OptimizerDtypes":
        bf16 = ds.get("bf16") or {}
        kind = str((ds.get("optimizer") or {}).get("type", "adam")).lower()
        return cls(2 if bf16.get("bf16_master_weights_and_grads") else 4,
                   2 if bf16.get("bf16_optimizer_states") else 4, kind == "muon")

    @classmethod
    def named(cls, optimizer: str, master_dtype: str = "fp32", state_dtype: str = "fp32") -> "OptimizerDtypes":
        """From the recipe's names (optimizer.type, master_dtype, state_dtype), as `harness plan` takes them."""
        return cls(2 if master_dtype == "bf16" else 4, 2 if state_dtype == "bf16" else 4, optimizer == "muon")


@dataclass(frozen=True)
class RunModel:
    model: str  # hub id, folder or preset name (train.model)
    model_config: Mapping[str, Any]  # the model's HF config as a dict, read once (read-only)
    precision: str  # bf16 | fp16 | fp32
    degrees: Degrees
    zero: Zero
    batch: Batch
    sequence: Sequence
    adapter: Adapter | None = None
    pipeline_partition: str = "parameters"
    pipe_partitioned: bool = True  # DeepSpeed's pipeline.pipe_partitioned: activations split over tp between stages
    preference: Preference | None = None  # None: the next-token objective (lm)
    completions: Completions | None = None  # grpo, gkd, distill: completions (None: lm or a preference objective)
    optimizer_states: int = ADAM_STATES  # fp32 tensors the optimizer keeps per trainable element (optimizer_states)
    optimizer_dtypes: OptimizerDtypes = OptimizerDtypes()  # bf16 master / states, Muon
    vision: Any = None  # a vision-language run: planner/vision.VisionLoad of its data's worst row (vision_steps.py)

    @classmethod
    def from_resolved(cls, recipe: Mapping, ds: Mapping, world: int, model_config: Mapping) -> "RunModel":
        """The run a resolved recipe and its resolved DeepSpeed dict describe on `world` ranks (degrees, ZeRO and
        batch as the DeepSpeed dict says: a --ds-config file may set them without the recipe)."""
        pp, tp = pipe_tensor_degrees(ds, recipe)
        train = recipe["train"]
        auto_ep = ds.get("expert_parallel") or {}
        ep = int(auto_ep.get("autoep_size", 1)) if auto_ep.get("enabled") else 1
        d = Degrees(world=world, tp=tp, pp=pp, sp=sequence_parallel(ds), ep=ep)
        micro = int(ds.get("train_micro_batch_size_per_gpu", 1))
        accum = int(ds.get("gradient_accumulation_steps", 1))
        batch = Batch(micro, accum, int(ds.get("train_batch_size", micro * accum * d.dp)))
        seq = Sequence(seq_len=int(train["seq_len"]), packing=packing(recipe), attention=train["attention"],
                       tiled_mlp=bool(train["tiled_mlp"]), tiled_loss=bool(train["tiled_loss"]),
                       tile_tokens=int(train["tile_tokens"]),
                       activation_checkpointing=bool(recipe["activation_checkpointing"]),
                       activation_offload=bool(train["activation_offload"]))
        lora = recipe["adapter"]
        adapter = Adapter(int(lora["r"]), tuple(lora["target_modules"])) if lora["type"] == "lora" else None
        pipe = ds.get("pipeline") or {}
        return cls(model=train["model"], model_config=MappingProxyType(dict(model_config)),
                   precision=recipe["precision"], degrees=d, zero=Zero.of(ds), batch=batch, sequence=seq,
                   adapter=adapter, pipeline_partition=pipe.get("partition", recipe["parallel"]["partition_method"]),
                   pipe_partitioned=bool(pipe.get("pipe_partitioned", True)), preference=_preference(recipe),
                   completions=completions(recipe), optimizer_states=optimizer_states(ds),
                   optimizer_dtypes=OptimizerDtypes.of(ds))


def completions(recipe: Mapping) -> Completions | None:
    """The run's completions objective with its extra model resolved (config/rl_rules.py, distill_rules.py); None
    for lm and the preference objectives."""
    from harness.config import distill_rules, rl_rules
    from harness.config.objectives import objective_of

    goal = objective_of(recipe)
    if goal.planner == "rollouts":
        rl = recipe["rl"]
        return Completions(goal.name, int(rl["max_prompt_length"]), int(rl["max_completion_length"]),
                           float(rl["beta"]), rl_rules.reference_mode(recipe))
    if goal.planner != "distill":
        return None
    block = distill_rules.settings(recipe)
    return Completions(goal.name, beta=float(block["beta"]),
                       teacher=block["teacher_model_name_or_path"] or recipe["train"]["model"],
                       teacher_mode=distill_rules.teacher_mode(recipe), on_policy=distill_rules.on_policy(recipe),
                       lmbda=float(block["lmbda"]), chunk_tokens=int(block["loss_chunk_tokens"]),
                       top_k=int(block.get("loss_top_k") or 1))


def _preference(recipe: Mapping) -> Preference | None:
    """The run's preference objective with its reference mode resolved; None for lm."""
    goal = objective(recipe)
    if not is_preference(recipe):
        return None
    pref = recipe["preference"]
    return Preference(goal, reference_mode(recipe), float(pref["beta"]), pref["reference"])
