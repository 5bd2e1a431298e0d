"""The sequence path of a run: the model prepared before the engine (attention, Ulysses mpu, tiling) and the
train / eval step functions the trainer uses instead of its plain ones (harness.train.trainer.strategy).

The sequence path is taken when parallel.sequence > 1, train.tiled_loss, train.tiled_mlp or
train.activation_offload is set; otherwise the plain path (transformers' own loss) runs unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def uses_sequence_path(spec) -> bool:
    train = spec.recipe["train"]
    return (spec.sp > 1 or train["attention"] not in ("auto", "sdpa")
            or bool(train["tiled_loss"] or train["tiled_mlp"] or train["activation_offload"]))


def attention_of(spec) -> str:
    from harness.model.sequence.attention import resolve

    return resolve(spec.recipe["train"]["attention"], spec.sp, torch.cuda.is_available())


def prepare(model, spec):
    """Before deepspeed.initialize: the attention implementation, tiling, and the Ulysses mpu (None at sp=1)."""
    from harness.model.sequence import attention, tiling, ulysses
    from harness.model.sequence.loss import enable_tiled_head

    train = spec.recipe["train"]
    name = attention_of(spec)
    if name != getattr(model.config, "_attn_implementation", None):
        attention.apply(model, name)
    if train["tiled_mlp"]:
        tiling.enable_tiled_mlp(model, train["tile_tokens"])
    if train["tiled_loss"]:
        enable_tiled_head(model, train["tile_tokens"])
    return ulysses.setup(model, name, spec.sp, spec.run.batch.micro_batch)


@dataclass
class Steps:
    sp: int
    sp_rank: int
    zero_stage: int
    tile: int | None
    offload: bool  # activation offload (CUDA): saved tensors of the forward go to pinned host memory

    @classmethod
    def of(cls, spec) -> "Steps":
        import torch.distributed as tdist

        train = spec.recipe["train"]
        rank = tdist.get_rank() if tdist.is_initialized() else 0
        return cls(sp=spec.sp, sp_rank=rank % spec.sp, zero_stage=spec.zero_stage,
                   tile=train["tile_tokens"] if train["tiled_loss"] else None,
                   offload=train["activation_offload"] and torch.cuda.is_available())

    def _loss(self, engine, batch):
        from harness.model.sequence.loss import micro_loss

        if self.offload:
            with torch.autograd.graph.save_on_cpu(pin_memory=True):
                return micro_loss(engine, batch, self.sp, self.sp_rank, self.zero_stage, self.tile)
        return micro_loss(engine, batch, self.sp, self.sp_rank, self.zero_stage, self.tile)

    def train(self, engine, batches: list) -> torch.Tensor:
        """One optimizer step; this rank's logged loss (its mean over ranks is the sp=1 loss)."""
        total = None
        for batch in batches:
            loss, logged = self._loss(engine, batch)
            engine.backward(loss)
            engine.step()
            total = logged.float() if total is None else total + logged.float()
        return total / len(batches)

    @torch.no_grad()
    def eval(self, engine, batches: list) -> float:
        """Sharded like training: each SP rank runs its slice of the sequence, never the whole."""
        return sum(float(self._loss(engine, batch)[1]) for batch in batches) / len(batches)
