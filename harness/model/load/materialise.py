"""Step 3 of a build by share: give the meta parameters of a stage or shard their values from the checkpoint.

Names: a parameter's checkpoint key is its HF module path plus its attribute. The pipe's wrappers
(EmbedPipe, DecoderLayerPipe, ...) and DeepSpeed's containers are not HF modules; the HF submodules they hold
are found by identity in the meta model's named_modules, and a module the split created (a RowParallelLinear)
takes its parent's path plus its attribute name. Split: a parameter the split marked tensor_model_parallel
reads its rank's part along partition_dim (slices.py); everything else reads whole.
"""

from __future__ import annotations

from torch import nn

from harness.model.load.slices import Request
from harness.model.parallel.tensor import split_dim


def hf_paths(model) -> dict[int, str]:
    """id(module) -> its HF path, for every module of the (meta) HF model ("" for the model itself). Take it
    after the split and use it at once: ids of modules the split replaced and freed are reused by new ones."""
    return {id(module): name for name, module in model.named_modules()}


def _holders(root: nn.Module, paths: dict[int, str]):
    """(module, attribute, HF key) for every parameter and persistent buffer slot under `root`, each module once."""
    seen: set[int] = set()
    stack = [(root, paths.get(id(root)))]
    while stack:
        module, path = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        slots = [(a, "p") for a, p in module._parameters.items() if p is not None]
        slots += [(a, "b") for a, b in module._buffers.items()
                  if b is not None and a not in module._non_persistent_buffers_set]
        for attr, kind in slots:
            if path is None:
                raise RuntimeError(f"{type(module).__name__}.{attr} belongs to no module of the HF model")
            yield module, attr, kind, f"{path}.{attr}" if path else attr
        for name, child in module._modules.items():
            if child is not None:
                known = paths.get(id(child))
                stack.append((child, known if known is not None else (None if path is None else
                                                                      f"{path}.{name}" if path else name)))


def _request(key: str, tensor, tp_rank: int, tp_size: int) -> Request:
    if not getattr(tensor, "tensor_model_parallel", False):
        return Request()
    dim = tensor.partition_dim
    assert dim == split_dim(key), f"{key}: split along {dim}, tensor.py's table says {split_dim(key)}"
    return Request(dim, tp_rank, tp_size)


def materialise(root: nn.Module, paths: dict[int, str], source, dtype, tp_rank: int = 0, tp_size: int = 1) -> int:
    """Replace the meta parameters (and persistent buffers) under `root` by this rank's tensors from `source`,
    in `dtype`. A weight held by several modules (tied) is read once and assigned to each. Returns the bytes
    materialised."""
    slots: dict[int, list] = {}
    keys: dict[int, tuple[str, object]] = {}
    stored = source.keys()
    for module, attr, kind, key in _holders(root, paths):
        tensor = getattr(module, attr)
        slots.setdefault(id(tensor), []).append((module, attr, kind))
        if id(tensor) not in keys or (key in stored and keys[id(tensor)][0] not in stored):
            keys[id(tensor)] = (key, tensor)  # a tied weight is read under the name the checkpoint stores
    requests = {key: _request(key, t, tp_rank, tp_size) for key, t in keys.values()}
    values = source.read(requests, dtype)
    total = 0
    for ident, (key, old) in keys.items():
        value = values[key]
        if tuple(value.shape) != tuple(old.shape):
            raise RuntimeError(f"{key}: read {list(value.shape)}, the module expects {list(old.shape)}")
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(value, requires_grad=old.requires_grad)
            for attr in ("tensor_model_parallel", "partition_dim", "partition_stride"):
                if hasattr(old, attr):
                    setattr(new, attr, getattr(old, attr))
        else:
            new = value.to(old.dtype) if not old.is_floating_point() else value
        for module, attr, kind in slots[ident]:
            (module._parameters if kind == "p" else module._buffers)[attr] = new
        total += value.numel() * value.element_size()
    return total
