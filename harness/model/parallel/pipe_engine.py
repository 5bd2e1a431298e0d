"""DeepSpeed's PipelineEngine in the harness: topology, engine build (pipeline and 3D), one optimizer step,
eval, and the probe logits a checkpoint keeps for export verification.

Rank layout is DeepSpeed's topology: axes (pipe, data) for a pipeline, (pipe, data, model) for 3D, so the
tensor-parallel ranks of a stage are consecutive (inside a node) and a stage spans data x model ranks.
Every rank of a stage's data-parallel replica reads the same rows (BatchPlan with the topology's data
coordinate); the engine only lets first- and last-stage ranks pull from the iterator.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from harness.errors import UsageError
from harness.model.lora_attach import attach
from harness.model.parallel import pipeline


def topology(spec):
    from deepspeed.runtime.pipe.topology import PipeDataParallelTopology, PipeModelDataParallelTopology

    if spec.tp > 1:
        return PipeModelDataParallelTopology(num_pp=spec.pp, num_mp=spec.tp, num_dp=spec.dp)
    return PipeDataParallelTopology(num_pp=spec.pp, num_dp=spec.dp)


def dp_coords(spec, rank: int) -> tuple[int, int]:
    """(dp_rank, dp_size) of a global rank in the pipeline topology."""
    return topology(spec).get_coord(rank).data, spec.dp


def is_pipeline(engine) -> bool:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def _check_stages(spec, config) -> None:
    """More stages than decoder layers leaves a stage with nothing but an embedding or a head (checked before
    launch for models whose shape is known; here for the rest)."""
    layers = getattr(config, "num_hidden_layers", None)
    if layers is not None and spec.pp > layers:
        raise UsageError(f"parallel.pipeline: {spec.pp} stages for {layers} decoder layers of "
                         f"{spec.recipe['train']['model']}: pipeline stages must not outnumber layers\n"
                         f"    fix: use at most {layers} stages")


def _shard_stage(module, config) -> tuple[int, int]:
    """3D: split this stage's decoder layers over the topology's model-parallel group (on meta, before they are
    materialised); (tensor rank, tensor size)."""
    from harness.model.parallel import tensor

    grid = module.mpu()
    group, rank, size = (grid.get_slice_parallel_group(), grid.get_slice_parallel_rank(),
                         grid.get_slice_parallel_world_size())
    tensor.supported(config, size)
    for layer in pipeline.local_decoder_layers(module):
        tensor.shard_decoder_layer(layer, config, group, rank, size)
    return rank, size


def build_stage(spec):
    """This rank's PipelineModule stage, loaded by share (harness/model/load): the HF model on meta -> the
    PipelineModule builds this stage's layers -> (3D) split on meta -> this rank's tensors read, cast -> moved to
    the device and the tied embedding synchronised by DeepSpeed. The partition is in the returned ModelInfo, the
    LoRA counts in its notes."""
    from harness.model.load import base, meta
    from harness.model.load.materialise import hf_paths, materialise

    from harness.model import attention

    model, source, info = base.open_model(spec)
    attention.apply(model, spec)  # the stages' layers read it from the shared config
    pipeline.supported(model.config)
    _check_stages(spec, model.config)
    dtype = meta.train_dtype(spec.recipe["precision"])
    notes = []

    def on_stage(module):
        rank, size = _shard_stage(module, model.config) if spec.tp > 1 else (0, 1)
        # paths after the split: it replaced the row-parallel linears, and a new module may reuse a freed id
        materialise(module, hf_paths(model), source, dtype, rank, size)
        base.check_materialised(module)
        # LoRA on this stage's own layers (peft's, or 3D's split ones), named by the whole model's modules
        group = module.mpu().get_slice_parallel_group() if spec.tp > 1 else None
        note = attach(module, spec, hf_model=model, tp_group=(group, rank, size) if spec.tp > 1 else None,
                      layers=pipeline.local_decoder_layers(module))
        notes.extend([note] if note else [])

    ds_pipe = spec.ds_config.get("pipeline", {})
    module, specs = pipeline.build_module(model, topology(spec), spec.run.pipeline_partition,
                                          int(ds_pipe.get("activation_checkpoint_interval", 0)), on_stage=on_stage)
    partition = pipeline.layout(module, specs, pipeline.hf_names(specs, model))
    return base.Built(module, dataclasses.replace(info, partition=partition), notes=tuple(notes))


def pipe_batch(batch: tuple) -> tuple:
    """A trainer batch as the pipe engine takes it: (inputs, labels), inputs (input_ids, position_ids) under
    document packing (pipeline.EmbedPipe passes the position ids on to every stage's attention)."""
    return ((batch[0], batch[2]), batch[1]) if len(batch) == 3 else tuple(batch)


def train_step(engine, batches: list) -> torch.Tensor:
    """One optimizer step over this replica's micro-batches; the loss averaged over micro-batches and
    data-parallel replicas, the same value on every rank (DeepSpeed all-reduces and broadcasts it inside
    train_batch every step: the pipe schedule synchronises the ranks anyway)."""
    return engine.train_batch(iter([pipe_batch(b) for b in batches])).detach().float()


@contextlib.contextmanager
def _any_shape(engine):
    """Eval and probe batches may differ in shape from training's: forget training's shapes (3D caches the
    partitioned activations' meta), send shapes with every micro-batch, then make training re-announce its shapes
    (all ranks reset, so both ends of each p2p agree)."""
    engine.reset_activation_shape()
    engine.dynamic_shape = True
    try:
        yield
    finally:
        engine.dynamic_shape = False
        engine.reset_activation_shape()


def eval_loss(engine, batches: list) -> float:
    """Mean loss over this replica's eval micro-batches and the data-parallel replicas."""
    with _any_shape(engine):
        loss = engine.eval_batch(iter([pipe_batch(b) for b in batches]), num_micro_batches=len(batches))
    return float(loss.float().mean())


def probe_logits(engine, probe_ids: torch.Tensor) -> torch.Tensor | None:
    """The last stage's logits on `probe_ids` (returned on global rank 0, None elsewhere; every rank calls)."""
    import torch.distributed as dist

    with _any_shape(engine):
        _, logits = engine.eval_batch(iter([(probe_ids, probe_ids)]), return_logits=True, num_micro_batches=1)
    topo = engine.grid.topology()
    src = min(topo.filter_match(pipe=engine.num_stages - 1))
    box = [logits.float().cpu() if dist.get_rank() == src else None]
    if src != 0:
        dist.broadcast_object_list(box, src=src)
    return box[0] if dist.get_rank() == 0 else None
