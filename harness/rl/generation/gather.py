"""ZeRO-3 weights for generation in bounded memory, never token by token through ZeRO's hooks.

Generating through ZeRO-3's module hooks gathers every parameter for every token and invalidates the prefetch trace
at each new sequence length (deepspeedai/DeepSpeed#4354). While the generator runs, ZeRO's hooks are taken off the
module (as TRL's unwrap_model_for_generation does) and put back after, and the weights are gathered one of two ways:

- whole: every partitioned parameter gathered once for the whole generate call (the plan says the model fits);
- groups: the parameters outside the decoder layers (embeddings, final norm, head) gathered for the whole call, and
  the decoder layers in consecutive groups whose gathered bytes fit the bound: a group is gathered as the forward
  enters its first layer and released as it leaves its last. Every decode step passes through every layer, so each
  group is gathered once per generated token, for ALL sequences of the batch at once: per token the rank receives
  (N-1)/N of the layers' bytes in len(groups) all-gathers (priced by planner/rl.py), instead of one all-gather per
  parameter with the hooks' bookkeeping. Peak gathered bytes = persistent + outside + the largest group.

Bytes are counted as gathered (ds_numel x element size): a partitioned parameter's numel() is 0."""

from __future__ import annotations

import contextlib

import torch


def is_zero3(module) -> bool:
    return any(hasattr(p, "ds_id") for p in module.parameters())


def gathered_bytes(param) -> int:
    """What the parameter occupies whole (ZeRO-3: ds_numel, since numel() of a partitioned one is 0)."""
    return int(getattr(param, "ds_numel", param.numel())) * param.element_size()


def decoder_layers(module) -> torch.nn.ModuleList:
    """The decoder's layer list: the longest ModuleList whose length is the config's num_hidden_layers."""
    config = getattr(module, "config", None)
    want = getattr(config, "num_hidden_layers", None)
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 0]
    if want is not None:
        lists = [m for m in lists if len(m) == want] or lists
    if not lists:
        raise ValueError(f"{type(module).__name__} has no decoder layer list (nn.ModuleList) to gather by groups")
    return max(lists, key=len)


def layer_groups(layers, bound_bytes: int | None, outside_bytes: int) -> list[list[int]]:
    """Consecutive layer indices per group: as many layers as fit bound_bytes - outside_bytes (at least one)."""
    if bound_bytes is None:
        return [list(range(len(layers)))]
    room = bound_bytes - outside_bytes
    groups, current, used = [], [], 0
    for i, layer in enumerate(layers):
        size = sum(gathered_bytes(p) for p in _partitioned(layer.parameters()))
        if current and used + size > room:
            groups.append(current)
            current, used = [], 0
        current.append(i)
        used += size
    return groups + [current] if current else groups


def _partitioned(params) -> list:
    return [p for p in params if hasattr(p, "ds_id") and not getattr(p, "ds_persist", False)]


def _zero_offload(engine):
    """DeepSpeed's DeepSpeedZeRoOffload that owns the ZeRO-3 module hooks of this engine."""
    opt = engine.optimizer
    return getattr(opt, "parameter_offload", opt)


@contextlib.contextmanager
def without_zero_hooks(engine):
    """ZeRO-3's forward/backward hooks off for the block, back on (with a fresh prefetch trace) after it."""
    from deepspeed.runtime.zero import parameter_offload

    offload = _zero_offload(engine)
    for p in offload.module.parameters():
        p.ds_active_sub_modules.clear()
    offload._remove_module_hooks()
    try:
        yield
    finally:
        offload.forward_hooks, offload.backward_hooks = [], []
        depth = len(parameter_offload.FWD_MODULE_STACK)
        offload.setup_zero_stage3_hooks()
        del parameter_offload.FWD_MODULE_STACK[depth:]  # setup pushes the root module again; it is there already


class GroupGather:
    """The layer groups' gather/release as forward hooks on each group's first and last layer."""

    def __init__(self, layers, groups: list[list[int]]):
        self.layers, self.groups = layers, groups
        self.open: dict[int, object] = {}
        self.handles = []

    def __enter__(self):
        import deepspeed

        for g, idx in enumerate(self.groups):
            params = _partitioned(p for i in idx for p in self.layers[i].parameters())

            def enter(_module, _args, g=g, params=params):
                if params:
                    ctx = deepspeed.zero.GatheredParameters(params)
                    ctx.__enter__()
                    self.open[g] = ctx

            def leave(_module, _args, _out, g=g):
                ctx = self.open.pop(g, None)
                if ctx is not None:
                    ctx.__exit__(None, None, None)

            self.handles.append(self.layers[idx[0]].register_forward_pre_hook(enter))
            self.handles.append(self.layers[idx[-1]].register_forward_hook(leave))
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()
        for ctx in self.open.values():  # a forward that raised inside a group
            ctx.__exit__(None, None, None)
        self.open.clear()


@contextlib.contextmanager
def zero3_weights(engine, module, bound_bytes: int | None):
    """Every ZeRO-3 weight available to `module`'s forward for the block, in at most `bound_bytes` gathered bytes
    (None: the whole model at once). Yields the layer groups used ([all layers] when whole)."""
    import deepspeed

    layers = decoder_layers(module)
    inside = {id(p) for p in layers.parameters()}
    everything = _partitioned(module.parameters())
    outside = [p for p in everything if id(p) not in inside]
    whole = bound_bytes is None or sum(map(gathered_bytes, everything)) <= bound_bytes
    with without_zero_hooks(engine):
        if whole:
            with deepspeed.zero.GatheredParameters(everything):
                yield [list(range(len(layers)))]
            return
        groups = layer_groups(layers, bound_bytes, sum(map(gathered_bytes, outside)))
        with deepspeed.zero.GatheredParameters(outside), GroupGather(layers, groups):
            yield groups
