"""The one compatibility shim between DeepSpeed AutoEP and transformers 5.23/5.24.

DeepSpeed 0.19.8 (deepspeed/module_inject/auto_ep_presets/base.py, _install_instance_transformers_output_recorders)
saves the entries it is about to replace in transformers' output-capture registry with the dict call
`registry.get(registry_key, _MISSING_REGISTRY_ENTRY)`. transformers 5.23/5.24 (utils/output_capturing.py) makes
that registry a `_CanRecordRegistry(dict)` whose `get(self, model)` takes one argument (a model, keyed by its class
name), so deepspeed.initialize with `expert_parallel.enabled` dies with `TypeError: _CanRecordRegistry.get() takes 2
positional arguments but 3 were given`. The shim lets `get` accept a default and then behave as dict.get does (the
key DeepSpeed passes is already the registry's string key); a call with one argument keeps transformers' meaning.
tests/test_moe_compat.py fails once either side changes (DeepSpeed's call or transformers' signature), so the shim
can be dropped then.
"""

from __future__ import annotations

_PATCHED = "_dsharness_accepts_default"
_NO_DEFAULT = object()


def patch_output_capture_registry() -> bool:
    """Make transformers' _CanRecordRegistry.get accept dict.get's default. True when it patched (once per process)."""
    from transformers.utils import output_capturing

    registry_cls = getattr(output_capturing, "_CanRecordRegistry", None)
    if registry_cls is None or getattr(registry_cls.get, _PATCHED, False):
        return False
    original = registry_cls.get

    def get(self, key, default=_NO_DEFAULT):
        if default is _NO_DEFAULT:
            return original(self, key)
        return dict.get(self, key, default)

    setattr(get, _PATCHED, True)
    registry_cls.get = get
    return True
