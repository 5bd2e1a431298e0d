"""What the planner is asked about, as frozen values: the workload one rank trains (Workload) and the machines it
runs on (Cluster). `harness plan` builds them from its flags, a run from its RunModel (planner/prediction.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, is_dataclass, replace

from harness.config.defaults import TILE_TOKENS
from harness.config.objectives import OBJECTIVES
from harness.config.run_model import ADAM_STATES, OptimizerDtypes
from harness.planner.vision import VisionLoad

RESERVE_FRACTION = 0.10  # of GPU, CPU and NVMe: CUDA context, NCCL buffers, fragmentation, the OS


@dataclass(frozen=True)
class TeacherLoad:
    """A distillation objective's teacher (planner/teacher.py prices it): its parameters, those ZeRO-3 keeps whole
    under the student's persistence threshold, its largest tensor and vocabulary; the mode (None: the planner
    recommends one per layout); the loss's beta and chunk; its top-k (precomputed, served); whether the completions
    are the student's own samples (on-policy: with probability lmbda per micro-batch, always where the data is
    prompts); the dataset's records (the precomputed store's size and its pass)."""

    name: str
    params: int
    persistent: int
    largest_tensor: int
    vocab_size: int
    is_student: bool  # the student's own model (self-distillation): the adapter mode's teacher
    beta: float  # the generalised JSD's (the loss's float32 working set depends on it)
    chunk_tokens: int  # distill.loss_chunk_tokens: the loss's float32 rows at a time
    mode: str | None = None
    top_k: int = 1
    on_policy: bool = False
    lmbda: float = 0.0
    records: int | None = None


@dataclass(frozen=True)
class Workload:
    """The sequences a layout trains: per rank and micro-step, and how they are handled."""

    seq_len: int = 2048  # `harness plan`'s default
    micro_batch: int = 1  # sequences per data-parallel replica per micro-step
    precision: str = "bf16"
    activation_checkpointing: bool = False  # the run's own; the long-context rung forces it on
    grad_accum: int = 1  # micro-steps per optimizer step
    attention: str = "flash"  # the kernel whose mask and scores count (planner/activations.py)
    activation_offload: bool = True  # False: the long-context rung leaves its offload rows out (CPU ranks)
    expert_imbalance: float | None = None  # MoE: busiest expert-parallel rank's tokens over the mean (moe/parallel.py)
    packing: str = "document"  # document rows send their position ids between pipeline stages
    global_batch: int | None = None  # sequences per optimizer step over all replicas (the step-time search)
    tile_tokens: int = TILE_TOKENS  # tiled MLP and loss: tokens per tile
    optimizer_states: int = ADAM_STATES  # fp32 tensors the optimizer keeps per trainable parameter (Adam's m and v)
    optimizer_dtypes: OptimizerDtypes = OptimizerDtypes()  # bf16 master weights / states, Muon (config/run_model.py)
    # the objective (harness/config/objectives.py; None: lm): its registry line says what a batch item is (rows) and
    # what is priced (planner: pairs, rollouts, distill). A preference objective's micro_batch and global_batch count
    # pairs, each two sequences (chosen, rejected); an RL or distillation objective's count completions, each one
    # row of prompt_len + completion_len tokens (seq_len is their sum). reference_mode: precomputed | engine |
    # adapter (None: none or not chosen yet); pairs: the preference set's size (precomputed: its host table and its
    # pass), steps: the optimizer steps trained; beta: rl.beta (0: TRL loads no reference)
    objective: str | None = None
    reference_mode: str | None = None
    pairs: int | None = None
    steps: int | None = None
    prompt_len: int | None = None
    completion_len: int | None = None
    beta: float | None = None
    # a distillation objective's teacher (planner/teacher.py): its size, mode, top-k and whether it is on-policy
    teacher: TeacherLoad | None = None
    # a vision-language model: the images an item runs through the vision tower and projector (planner/vision.py)
    vision: VisionLoad | None = None

    @property
    def rows_per_item(self) -> int:
        """Sequences per micro-batch item (the registry's rows): a preference pair is two, a completion one."""
        return OBJECTIVES[self.objective].rows if self.objective else 1

    @property
    def terms(self) -> str:
        """What the planner prices for the objective (the registry's planner field): rows, pairs, rollouts, distill."""
        return OBJECTIVES[self.objective].planner if self.objective else "rows"

    def but(self, **changes) -> "Workload":
        """This workload with some fields changed."""
        return replace(self, **changes)

    def to_dict(self) -> dict:
        """The plan's "workload" (fields left unset are left out)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}
        return {k: asdict(v) if is_dataclass(v) else v for k, v in out.items()}


@dataclass(frozen=True)
class LongContext:
    """How a rank handles a long sequence (planner/activations.py): the Ulysses degree, tiled MLP and loss, and the
    checkpointed block inputs offloaded to CPU RAM."""

    sp: int = 1
    tiled_mlp: bool = False
    tiled_loss: bool = False
    offload: bool = False


@dataclass(frozen=True)
class Cluster:
    """The machines: nodes of gpus_per_node GPUs; memory per GPU, CPU RAM and NVMe per node (None: not given),
    each usable up to RESERVE_FRACTION short of it."""

    gpus_per_node: int
    gpu_mem_bytes: int
    nodes: int = 1
    cpu_mem_bytes: int | None = None
    nvme_bytes: int | None = None
    reserve_fraction: float = RESERVE_FRACTION

    @property
    def world(self) -> int:
        return self.gpus_per_node * self.nodes

    def _usable(self, nbytes: int | None) -> int | None:
        return None if nbytes is None else int(nbytes * (1 - self.reserve_fraction))

    @property
    def usable_gpu_bytes(self) -> int:
        return self._usable(self.gpu_mem_bytes)

    @property
    def usable_cpu_bytes(self) -> int | None:
        return self._usable(self.cpu_mem_bytes)

    @property
    def usable_nvme_bytes(self) -> int | None:
        return self._usable(self.nvme_bytes)

    def with_nodes(self, nodes: int) -> "Cluster":
        return replace(self, nodes=nodes)

    def to_dict(self) -> dict:
        """The plan's "hardware"."""
        return {"gpus_per_node": self.gpus_per_node, "nodes": self.nodes, "world": self.world,
                "gpu_mem_bytes": self.gpu_mem_bytes, "cpu_mem_bytes": self.cpu_mem_bytes, "nvme_bytes": self.nvme_bytes,
                "usable_gpu_bytes": self.usable_gpu_bytes, "usable_cpu_bytes": self.usable_cpu_bytes,
                "usable_nvme_bytes": self.usable_nvme_bytes, "reserve_fraction": self.reserve_fraction}

