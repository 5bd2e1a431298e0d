"""Pipeline and tensor-parallel axes: which layers each stage holds, what each rank sends per step.

The layer -> stage split is DeepSpeed 0.19.8's own (deepspeed/runtime/pipe/module.py `_partition_layers`):
partition_method "uniform" splits the layer count evenly (runtime/utils.py `partition_uniform`), "parameters"
(the default) balances the layers' trainable parameter counts with `partition_balanced`, a dynamic program
over (max - min) part sums whose ties go to the LAST split point examined. Both are replicated here line for
line (tests hold them equal to DeepSpeed's functions), so the split is exact, not estimated.

The harness lays a model out as DeepSpeed sees it (harness/model/parallel/pipeline.py):
    [token embedding, (GPT-2: learned positions), block 0 .. block L-1, final norm, LM head]
A tied head is a TiedLayerSpec of the embedding module: `_count_layer_params` builds it and counts the whole
embedding again, and the last stage holds its own copy (its gradient is all-reduced with the first stage's
once per step). Tensor parallelism splits each block's column/row-parallel weights over tp ranks; the
embedding, final norm and head stay whole on every tensor-parallel rank.

Traffic per step (logged bytes, comms-logger convention), A = micro x seq x hidden activation elements:
  p2p     per micro-batch a stage with a next stage sends A forward and receives A's gradient; one with a
          previous stage receives A and sends its gradient back (DeepSpeed's p2p.send/recv are deepspeed.comm
          send/recv on torch >= 1.8, so the comms logger sees them). Shapes (256 int32 = 1 KiB) travel on the
          first step, and again on the first step after an eval (the harness resets them for eval batches):
          left out of the per-step prediction.
  3D      with tensor parallelism, DeepSpeed's pipe engine sends only this rank's 1/tp slice of A
          (pipeline.pipe_partitioned / grad_partitioned, both on by default) plus a small long tensor of
          partition meta, and rebuilds the whole tensor with an all_gather_into_tensor over the tp group:
          on receiving activations, and on the sending stage twice in backward (its output, the gradient).
  TP      per block per micro-batch: an all-reduce of A after attention and after the MLP in forward, and of
          the input gradients before them in backward (Megatron f/g); recomputation adds two.
  tied    the tied embedding's gradient, all-reduced between the first and the last stage.
"""

from __future__ import annotations

from harness.config.defaults import PRECISION_BYTES
from harness.planner.inputs import Workload
from harness.planner.memory import FP32_BYTES
from harness.planner.shape import ModelShape
from harness.planner.params import ParamCount

PARTITION_METHODS = ("parameters", "uniform")
LONG_BYTES = 8


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_uniform: part boundaries, the first `residual` parts one larger."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, residual = divmod(num_items, num_parts)
    return [p * chunk + min(p, residual) for p in range(num_parts + 1)]


def partition_balanced(weights: list[int], num_parts: int) -> list[int]:
    """deepspeed.runtime.utils.partition_balanced: minimise (largest - smallest) part sum; same tie-breaking.

    The dynamic program's cell (i, j) (the first i layers in j parts) does not depend on the number of parts
    asked for, so one table serves every pipeline depth up to the one it was built for: the search asks for
    many depths of the same layers. Split points k < j - 1 are skipped: their cost is infinite and never wins
    over a finite one, so the result is DeepSpeed's exactly (tests hold it equal)."""
    n = len(weights)
    if n <= num_parts:
        return partition_uniform(n, num_parts)
    position = _table(tuple(weights), num_parts)
    parts = [n]
    for j in reversed(range(1, num_parts + 1)):
        parts.append(position[parts[-1]][j])
    return parts[::-1]


_TABLES: dict[tuple[int, ...], list[list[int]]] = {}


def _table(weights: tuple[int, ...], num_parts: int) -> list[list[int]]:
    """position[i][j]: DeepSpeed's chosen last split for the first i layers in j parts, j up to >= num_parts."""
    table = _TABLES.get(weights)
    if table is not None and len(table[0]) > num_parts:
        return table
    n = len(weights)
    m = min(n, max(num_parts, 2 * (len(table[0]) - 1) if table else 16))
    inf = float("inf")
    dp_max = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (m + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (m + 1) for _ in range(n + 1)]
    position = [[0] * (m + 1) for _ in range(n + 1)]
    prefix = [0.0] * (n + 1)
    for i, w in enumerate(weights):
        prefix[i + 1] = prefix[i] + float(w)
    dp_max[0][0] = dp_cost[0][0] = 0
    for i in range(1, n + 1):
        for j in range(1, min(i, m) + 1):
            best_cost, best = inf, None
            for k in range(j - 1, i):
                part = prefix[i] - prefix[k]
                max_sum, min_sum = max(dp_max[k][j - 1], part), min(dp_min[k][j - 1], part)
                cost = max_sum - min_sum
                if best_cost >= cost:  # `>=`: a later k wins a tie, as in DeepSpeed
                    best_cost, best = cost, (max_sum, min_sum, k)
            dp_cost[i][j] = best_cost
            dp_max[i][j], dp_min[i][j], position[i][j] = best
    if len(_TABLES) > 64:
        _TABLES.clear()
    _TABLES[weights] = position
    return position


def layer_specs(count: ParamCount, tp: int = 1) -> list[tuple[str, int]]:
    """(name, trainable parameters as `_count_layer_params` counts them) for each PipelineModule layer.
    GPT-2's learned positions are a layer of their own after the token embedding, which alone is tied."""
    tokens = count.embedding - count.positions
    block = count.block_params(tp)
    head = tokens if count.lm_head == 0 else count.lm_head
    positions = [("positions", count.positions)] if count.positions else []
    return [("embedding", tokens), *positions, *[(f"block{i}", block) for i in range(count.num_layers)],
            ("final_norm", count.other), ("lm_head", head)]


def partition(count: ParamCount, pp: int, method: str = "parameters", tp: int = 1,
              counted_tp: int | None = None) -> list[int]:
    """Layer boundaries of the pp stages: stage s holds layers [parts[s], parts[s+1]).

    counted_tp: the split of the blocks that DeepSpeed's `_count_layer_params` sees when it builds each layer
    to weigh it: 1 when the stage splits its blocks after the PipelineModule is built (the harness:
    harness/model/parallel/pipe_engine.py, the default), tp when a layer is split as it is built."""
    specs = layer_specs(count, 1 if counted_tp is None else counted_tp)
    if method == "uniform":
        return partition_uniform(len(specs), pp)
    if method == "parameters":
        return partition_balanced([n for _, n in specs], pp)
    raise ValueError(f"pipeline partition method {method!r}: the planner knows {', '.join(PARTITION_METHODS)}")


def stages(count: ParamCount, pp: int, method: str = "parameters", tp: int = 1,
           counted_tp: int | None = None) -> list[dict]:
    """Per stage: its layers, blocks, and the parameters one of its ranks holds (a tied embedding counted once
    per stage that holds either end)."""
    specs = layer_specs(count, tp)
    parts = partition(count, pp, method, tp, counted_tp)
    tied = count.lm_head == 0
    out = []
    for s in range(pp):
        held = specs[parts[s]:parts[s + 1]]
        names = [name for name, _ in held]
        params = sum(n for name, n in held)
        if tied and "embedding" in names and "lm_head" in names:
            params -= count.embedding - count.positions  # one module, built once on a stage holding both ends
        out.append({"stage": s, "layers": [parts[s], parts[s + 1]], "names": names, "params": params,
                    "blocks": sum(name.startswith("block") for name in names),
                    "tied_copy": tied and pp > 1 and ("embedding" in names or "lm_head" in names)})
    return out


def activation_elems(shape: ModelShape, seq_len: int, micro_batch: int) -> int:
    """Elements of the hidden states crossing a stage boundary per micro-batch."""
    return micro_batch * seq_len * shape.hidden_size


def p2p_bytes(shape: ModelShape, work: Workload, *, stage: int, pp: int, micro_batches: int, tp: int = 1,
              partitioned: bool = True) -> dict[str, int]:
    """Logged bytes per step of one rank of `stage` (work: its sequence, micro-batch, precision and packing): send,
    recv and (3D) the tp all-gathers that rebuild partitioned activations. Steady state: the shape meta of the first
    step is left out. Under document packing every forward message also carries the micro-batch's int64 position
    ids, whole (DeepSpeed partitions only the first tensor of a tuple; an integer tensor sends no gradient back)."""
    if pp <= 1:
        return {}
    seq_len, micro_batch, lp = work.seq_len, work.micro_batch, PRECISION_BYTES[work.precision]
    a = activation_elems(shape, seq_len, micro_batch)
    sliced = partitioned and tp > 1
    # the rank's slice: partition_uniform over the flat tensor, the first ranks one element larger
    part = (-(-a // tp) if sliced else a) * lp
    meta = LONG_BYTES * (1 + 3 + 2 + tp + 1) if sliced else 0  # [ndims, 3 dims, parts, rank, tp+1 bounds]
    per_message = part + meta
    neighbours = (stage > 0) + (stage < pp - 1)
    out = {"send": neighbours * per_message * micro_batches, "recv": neighbours * per_message * micro_batches}
    if work.packing == "document":
        ids = LONG_BYTES * seq_len * micro_batch * micro_batches
        out["send"] += ids * (stage < pp - 1)
        out["recv"] += ids * (stage > 0)
    if sliced:  # receive side rebuilds the input; the sending side its output and the gradient in backward
        gathers = (stage > 0) + 2 * (stage < pp - 1)
        out["all_gather_into_tensor"] = gathers * part * micro_batches
    return out


def tp_allreduce_bytes(shape: ModelShape, *, tp: int, blocks: int, seq_len: int, micro_batch: int, micro_batches: int,
                       precision: str, activation_checkpointing: bool = False) -> int:
    """Logged all-reduce bytes per step of one tensor-parallel rank holding `blocks` blocks: per block and
    micro-batch two in forward (after o_proj and down_proj), two in backward (the gradients of the column-
    parallel inputs), two more when the forward is recomputed."""
    if tp <= 1:
        return 0
    per_call = PRECISION_BYTES[precision] * activation_elems(shape, seq_len, micro_batch)
    return per_call * (6 if activation_checkpointing else 4) * blocks * micro_batches


def tied_allreduce_bytes(count: ParamCount, *, stage: int, pp: int, precision: str,
                         bf16_optimizer: bool = False) -> int:
    """The tied embedding's gradient, all-reduced between the end stages once per step (fp32 when DeepSpeed's
    BF16 optimizer keeps fp32 gradients)."""
    if pp <= 1 or count.lm_head != 0 or stage not in (0, pp - 1):
        return 0
    return (count.embedding - count.positions) * (FP32_BYTES if bf16_optimizer else PRECISION_BYTES[precision])


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """Idle share of a 1F1B pipeline step: (p - 1) / (m + p - 1)."""
    return (pp - 1) / (micro_batches + pp - 1) if pp > 1 else 0.0
