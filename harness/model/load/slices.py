"""Which part of a checkpoint tensor a rank owns: one small mapping per way a tensor is split.

The kinds follow tensor.py's COLUMN/ROW table (the one source of truth for which tensor splits how):
  replicated  dim None: the whole tensor (norms, embeddings, heads, row-parallel biases)
  column      dim 0: rows [rank*n, (rank+1)*n) of the output features (q/k/v, gate/up, their biases)
  row         dim 1: input columns [rank*n, (rank+1)*n) (o_proj, down_proj weights)
`owned` works on a safetensors slice handle (reads only that range) and on a torch tensor alike.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    """Read the `rank`-th of `size` equal parts along `dim` (None: the whole tensor)."""

    dim: int | None = None
    rank: int = 0
    size: int = 1

    @property
    def kind(self) -> str:
        return {None: "replicated", 0: "column", 1: "row"}[self.dim]


def index_of(shape, req: Request) -> tuple:
    """The slice of a tensor of `shape` that `req` owns."""
    if req.dim is None or req.size == 1:
        return tuple(slice(None) for _ in shape)
    if shape[req.dim] % req.size:
        raise ValueError(f"dim {req.dim} of shape {list(shape)} does not split into {req.size} equal parts")
    part = shape[req.dim] // req.size
    return tuple(slice(req.rank * part, (req.rank + 1) * part) if d == req.dim else slice(None)
                 for d in range(len(shape)))


def owned(handle, req: Request):
    """This rank's part of a tensor (safetensors PySafeSlice or torch.Tensor)."""
    shape = handle.get_shape() if hasattr(handle, "get_shape") else tuple(handle.shape)
    if not shape:  # a scalar: safetensors slices need at least one dim
        return handle[...] if not hasattr(handle, "get_shape") else handle[:]
    return handle[index_of(shape, req)]
