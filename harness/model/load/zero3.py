"""ZeRO-3 from a checkpoint folder: partitioned at construction, then filled one module at a time.

The model is constructed under deepspeed.zero.Init (transformers' from_config with the HF DeepSpeed config
registered, harness/model/hf.py), so each parameter is split over the data-parallel ranks as its module is
built and no rank ever holds the whole model. Then, module by module, its own parameters are gathered
(deepspeed.zero.GatheredParameters, modifier_rank=0); rank 0 reads just those tensors from the safetensors
files (source.py, as stored) and copies them in, which casts to the training dtype; leaving the context
broadcasts rank 0's values and re-partitions them. A rank's private peak is therefore its 1/N share plus the
largest module gathered whole, plus on rank 0 the largest tensor as read (planner/load.py).

transformers' own from_pretrained under zero.Init reads a whole checkpoint file's state dict on every rank
first (measured on a 0.2B bf16 folder trained fp32 on 2 ranks: +736 / +1,022 MB per rank, about the whole
fp32 model), which is why folders do not go through it here.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util

import torch

from harness.model.load.slices import Request

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter (malloc.h)
MMAP_THRESHOLD_LOAD_BYTES = 1 << 20
MMAP_THRESHOLD_AFTER_BYTES = 32 << 20  # glibc's ceiling for its dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX)


@contextlib.contextmanager
def large_tensors_mapped():
    """Give every freed tensor of 1 MiB or more back to the kernel while loading.

    glibc raises its mmap threshold to the size of each mmapped block freed (up to 32 MiB), so after the first
    freed layer-sized tensor, gathered copies and full-size construction tensors come from the heap, and the
    holes they leave between the kept 1/N partitions are not returned: measured on a 0.2B fp32 model on 2 ranks,
    +911 MiB private after construction on one rank where its share is 395 MiB (malloc_trim gave back 460).
    A fixed threshold keeps them mapped; afterwards it is fixed at 32 MiB, where the dynamic one ends up anyway
    once a run has freed a few tensors. Not glibc (musl, jemalloc preloaded): nothing changes."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        yield
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_LOAD_BYTES)
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_AFTER_BYTES)


def construct(config, dtype: torch.dtype, ds_config: dict):
    """The model built under zero.Init (parameters partitioned as they are created) with transformers'
    ZeRO-3 initialisation; the values are overwritten by `fill`."""
    from harness.model.hf import ATTN_IMPLEMENTATION, _zero3_context, auto_class
    from harness.config.moe_families import attn_implementation

    with _zero3_context(ds_config):
        return auto_class(config).from_config(config, dtype=dtype,  # gpt-oss: eager (config/moe_families.py)
                                                attn_implementation=attn_implementation(config, ATTN_IMPLEMENTATION))


def _keys(model, stored: set[str]) -> dict[int, str]:
    """id(parameter) -> its checkpoint key; a tied weight under the name the checkpoint stores."""
    keys: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in keys or (name in stored and keys[id(param)] not in stored):
            keys[id(param)] = name
    return keys


def fill(model, source) -> int:
    """Give every partitioned parameter of `model` its checkpoint value (read on rank 0 only) and every
    persistent buffer its stored value (read on each rank: buffers are not partitioned). Returns the bytes
    rank 0 read."""
    import deepspeed

    stored = source.keys()
    keys = _keys(model, stored)
    rank0 = deepspeed.comm.get_rank() == 0
    done: set[int] = set()
    total = 0
    with torch.no_grad():
        for module in model.modules():
            params = [p for p in module.parameters(recurse=False) if id(p) not in done]
            if not params:
                continue
            done.update(id(p) for p in params)
            with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
                if rank0:
                    total += _copy_in(params, keys, source)
        _fill_buffers(model, source)
    return total


def _copy_in(params, keys: dict[int, str], source) -> int:
    values = source.read({keys[id(p)]: Request() for p in params}, None)
    total = 0
    for param in params:
        key = keys[id(param)]
        value = values.pop(key)
        if tuple(value.shape) != tuple(param.shape):
            raise RuntimeError(f"{key}: read {list(value.shape)}, the module expects {list(param.shape)}")
        param.data.copy_(value)  # casts to the training dtype as it copies
        total += value.numel() * value.element_size()
    return total


def _fill_buffers(model, source) -> None:
    stored = source.keys()
    for mod_name, module in model.named_modules():
        for attr, buf in module._buffers.items():
            key = f"{mod_name}.{attr}" if mod_name else attr
            if buf is not None and attr not in module._non_persistent_buffers_set and key in stored:
                buf.copy_(source.read({key: Request()}, None)[key])
