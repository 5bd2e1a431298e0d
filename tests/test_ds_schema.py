"""harness/schemas/ds_config.schema.json must stay true to the installed DeepSpeed (0.19.8), in both directions:
no key DeepSpeed reads is missing (unless listed as removed/deprecated/out of scope/excluded), no schema key is
one DeepSpeed does not read, defaults agree, and every example config is also accepted by DeepSpeedConfig."""
import copy
import dataclasses
import json
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from deepspeed.comm.config import CommsLoggerConfig
from deepspeed.compile.config import CompileConfig
from deepspeed.module_inject.autotp_config import AutoTPConfig, TPLayerSpec
from deepspeed.monitor import config as mon
from deepspeed.runtime import config as dsc, precision_config as prec
from deepspeed.runtime.tensor_parallel import config as tp
from deepspeed.runtime.zenflow.zenflow_config import ZenFlowConfig
from deepspeed.runtime.zero import config as zc, leaf_module_config as leaf, offload_config as off
from deepspeed.utils.config import DeepSpeedThroughputTimerConfig

from helpers import deepspeed_verdict as truth

SCHEMA = json.loads((Path(__file__).parents[1] / "harness/schemas/ds_config.schema.json").read_text())
VALIDATOR = Draft202012Validator(SCHEMA)
REMOVED, DEPRECATED, OUT_OF_SCOPE = SCHEMA["x-removed-keys"], SCHEMA["x-deprecated-keys"], SCHEMA["x-out-of-scope-keys"]

PYDANTIC_BLOCKS = {
    "zero_optimization": zc.DeepSpeedZeroConfig, "zero_optimization.offload_param": off.DeepSpeedZeroOffloadParamConfig,
    "zero_optimization.offload_optimizer": off.DeepSpeedZeroOffloadOptimizerConfig,
    "zero_optimization.zenflow": ZenFlowConfig, "zero_optimization.leaf_module": leaf.DeepSpeedZeroLeafModuleConfig,
    "fp16": prec.DeepSpeedFP16Config, "bf16": prec.DeepSpeedBF16Config, "comms_logger": CommsLoggerConfig,
    "tensorboard": mon.TensorBoardConfig, "csv_monitor": mon.CSVConfig, "wandb": mon.WandbConfig,
    "comet": mon.CometConfig, "tensor_parallel": tp.TPTrainingConfig, "tensor_parallel.tp": tp.TPConfig,
    "timers.throughput": DeepSpeedThroughputTimerConfig, "compile": CompileConfig,
}
EXCLUDED = {  # model fields deliberately absent from the schema
    "zero_optimization.zenflow.steps_per_epoch": "set by ZenFlow at run time ('should not be set by users')",
    "tensor_parallel.dtype": "typed torch.dtype: any JSON value (even \"bf16\") fails pydantic validation",
    "tensor_parallel.injection_policy_tuple": "a tuple of Python classes, not expressible in JSON",
    "tensor_parallel.tp.mpu": "a Python model-parallel-unit object",
    "tensor_parallel.tp.tp_group": "a torch process group object",
}
READ_ELSEWHERE = {  # top-level schema keys that DeepSpeedConfig does not probe offline
    "$schema": "JSON Schema reference for editors; DeepSpeed never reads it",
    "sequence_parallel_size": "read when a process group exists, by deepspeed.initialize and DeepCompile",
    "data_parallel_size": "read by deepspeed.initialize() to build the DP x SP mesh",
}
DICT_BLOCKS = ["activation_checkpointing", "flops_profiler", "aio", "checkpoint", "checkpoint.writer",
               "checkpoint.parallel_write", "data_types", "torch_autocast", "timers", "autotuning", "data_efficiency",
               "data_efficiency.data_sampling", "data_efficiency.data_routing"]
NATIVE_AUTO = {  # DeepSpeed's own "auto" values (not Hugging Face placeholders)
    "pipeline.stages", "data_types.keep_in_fp32_modules", "zero_optimization.zenflow.select_strategy",
    "zero_optimization.zenflow.select_interval", "zero_optimization.zenflow.update_interval"}
MISSING = object()


def node(path):
    n = SCHEMA
    for part in path.split(".") if path else []:
        n = n["properties"][part]
    return n


def keys(path):
    return set(node(path)["properties"])


def leaves(n=SCHEMA, prefix=""):
    for k, sub in n.get("properties", {}).items():
        yield from (leaves(sub, prefix + k + ".") if "properties" in sub else [(prefix + k, sub)])


def objects(n):
    if isinstance(n, (dict, list)):
        yield from [n] if "properties" in n else []
        for v in n.values() if isinstance(n, dict) else n:
            yield from objects(v)


def nested(path, value, base=None):
    cfg = d = copy.deepcopy(base or {"train_batch_size": 8})
    for p in path.split(".")[:-1]:
        d = d.setdefault(p, {})
    d[path.split(".")[-1]] = value
    return cfg


def as_json(v):
    return json.loads(json.dumps(v, default=lambda o: getattr(o, "value", str(o))))


def errors(cfg):
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in VALIDATOR.iter_errors(cfg)]


def test_schema_is_valid_draft_2020_12_and_closed_at_every_level():
    Draft202012Validator.check_schema(SCHEMA)
    assert SCHEMA["$id"] == "ds_config.schema.json"
    open_ok = [node("optimizer.params"), node("scheduler.params")]  # keys vary by optimizer/scheduler type
    for obj in objects(SCHEMA):
        assert obj["additionalProperties"] is any(obj is o for o in open_ok), obj["description"]


@pytest.mark.parametrize("path", sorted(PYDANTIC_BLOCKS))
def test_pydantic_block_matches_model_fields(path):
    cls, schema_keys = PYDANTIC_BLOCKS[path], keys(path)
    fields = {(f.alias or name): (name, f) for name, f in cls.model_fields.items()}
    for key, (name, f) in fields.items():
        full = f"{path}.{key}"
        if (f.json_schema_extra or {}).get("deprecated"):
            assert full in DEPRECATED and key not in schema_keys, full
        if f.alias and f.alias != name:  # populate_by_name: the python name is accepted too
            assert f"{path}.{name}" in DEPRECATED, f"{path}.{name}"
        assert key in schema_keys or full in DEPRECATED or full in REMOVED or full in EXCLUDED, f"missing {full}"
        sub = node(full) if key in schema_keys else {}
        if "properties" in sub:
            assert full in PYDANTIC_BLOCKS or full == "tensor_parallel.partition_config", f"unchecked block {full}"
        elif "default" in sub:
            assert as_json(f.get_default(call_default_factory=True)) == sub["default"], f"default of {full}"
    assert not schema_keys - fields.keys(), f"schema keys that {cls.__name__} lacks"


def test_dataclass_blocks_match_autotp():
    pc = node("tensor_parallel.partition_config")["properties"]
    assert set(pc) == {f.name for f in dataclasses.fields(AutoTPConfig)}
    assert set(pc["layer_specs"]["items"]["properties"]) == {f.name for f in dataclasses.fields(TPLayerSpec)}


class Rec(dict):
    """A dict that logs which keys DeepSpeed probes (get / in / [] / keys()) and get()'s default.
    copy.copy() keeps the subclass and its attributes, so DeepSpeedConfig's shallow copy still logs."""

    def __init__(self, log, path="", data=()):
        super().__init__(data)
        self.log, self.path = log, path

    def _note(self, k, default=MISSING):
        if default is not MISSING or self.path + k not in self.log:
            self.log[self.path + k] = default
        return k

    def get(self, k, default=None):
        return super().get(self._note(k, default), default)

    def __contains__(self, k):
        return super().__contains__(self._note(k))

    def __getitem__(self, k):
        return super().__getitem__(self._note(k))

    def keys(self):  # `key in d.keys()` would bypass __contains__
        return type("Keys", (), {"__contains__": lambda _, k: k in self, "__iter__": lambda _: iter(dict(self))})()


@pytest.fixture(scope="module")
def probed():
    log = {}
    blocks = {b: Rec(log, b + ".") for b in DICT_BLOCKS}
    for b in DICT_BLOCKS:  # nest "checkpoint.writer" into "checkpoint", ... and the top level into cfg
        parent, _, child = b.rpartition(".")
        dict.__setitem__(blocks.setdefault(parent, Rec(log, "", {"train_batch_size": 8})), child, blocks[b])
    dsc.DeepSpeedConfig(blocks[""])
    return log


def test_top_level_keys_match_what_deepspeed_reads(probed):
    read = {k for k in probed if "." not in k}
    known = keys("") | REMOVED.keys() | DEPRECATED.keys() | OUT_OF_SCOPE.keys()
    assert not read - known, "top-level keys DeepSpeed reads that the schema does not know"
    assert not keys("") - read - READ_ELSEWHERE.keys(), "schema keys DeepSpeedConfig never reads"
    assert not keys("") & (REMOVED.keys() | DEPRECATED.keys() | OUT_OF_SCOPE.keys())


@pytest.mark.parametrize("block", DICT_BLOCKS)
def test_dict_block_matches_what_deepspeed_reads(probed, block):
    read = {k[len(block) + 1:] for k in probed if k.startswith(block + ".") and "." not in k[len(block) + 1:]}
    assert read == keys(block)


def test_defaults_match_what_deepspeed_reads(probed):
    for path, default in probed.items():
        n = node(path) if path.split(".")[0] in SCHEMA["properties"] else {}
        if default is not MISSING and "default" in n and "properties" not in n:
            assert as_json(default) == n["default"], path
    pipe = dsc.get_pipeline_config({})
    assert keys("pipeline") == set(pipe) | {"use_reentrant"}  # use_reentrant is read by runtime/pipe/engine.py
    assert all(node(f"pipeline.{k}")["default"] == v for k, v in pipe.items())


def test_removed_and_deprecated_lists():
    assert set(REMOVED) == set(dsc._REMOVED_TOP_LEVEL_CONFIG_KEYS) | {
        f"zero_optimization.{k}" for k in dsc._REMOVED_ZERO_CONFIG_KEYS}
    for path in REMOVED:
        with pytest.raises(dsc.DeepSpeedConfigError):
            dsc.DeepSpeedConfig(nested(path, {}))
        assert errors(nested(path, {})), path
    for path, new in DEPRECATED.items():
        assert errors(nested(path, True)), path
        parent = new.rsplit(".", 1)[0] if "." in new else ""
        assert new.rsplit(".", 1)[-1] in keys(parent), new


def hf_filled_keys() -> set[str]:
    """The keys the HF Trainer (HfTrainerDeepSpeedConfig) and accelerate (_prepare_deepspeed) fill: every schema leaf
    set to "auto" on a ZeRO-3 config, run through their real fill code; what is no longer "auto" was filled."""
    cfg = {}
    for path, _ in leaves():
        cfg = nested(path, "auto", cfg)
    cfg["zero_optimization"]["stage"] = 3
    filled = truth.hf_fill(cfg, 8, 64)
    return {p for p, _ in leaves() if p != "zero_optimization.stage" and get(filled, p) != "auto"}


def get(d, path):
    for part in path.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


EXPECTED_AUTO = hf_filled_keys()


def test_auto_only_where_the_hf_trainer_or_accelerate_fills_it():
    assert {p for p, n in leaves() if n.get("x-auto")} == EXPECTED_AUTO
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in EXPECTED_AUTO  # accelerate's
    base = {"train_batch_size": 8, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}
    for path, n in leaves():
        if n.get("x-auto") or path in NATIVE_AUTO:
            assert not errors(nested(path, "auto", base)), path
        elif errors(nested(path, "no-such-value", base)):  # free-form strings ("auto" is a valid path) aside
            assert errors(nested(path, "auto", base)), f'"auto" accepted at {path}'


ZERO3_NVME = {
    "$schema": "ds_config.schema.json", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
    "steps_per_print": 10, "gradient_clipping": 1.0, "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-4,
                                                      "warmup_num_steps": 100, "total_num_steps": 1000}},
    "zero_optimization": {  # 5e8 etc. are JSON floats: pydantic int fields take integral floats, so does the schema
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8,
        "sub_group_size": 1e9, "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
        "offload_param": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 5, "buffer_size": 1e8},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "buffer_count": 4, "pipeline_read": True}},
    "aio": {"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1, "overlap_events": True},
    "activation_checkpointing": {"partition_activations": False}, "checkpoint": {"tag_validation": "Warn"}}
ZERO2_CPU = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
             "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "communication_data_type": "bf16",
             "zero_optimization": {"stage": 2, "allgather_bucket_size": 2e8, "offload_optimizer": {"device": "cpu"}},
             "comms_logger": {"prof_all": True}, "csv_monitor": {"enabled": True, "output_path": "out/"},
             "flops_profiler": {"enabled": True, "profile_step": 2}, "timers": {"throughput": {"synchronized": False}}}
PIPELINE = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
            "pipeline": {"activation_checkpoint_interval": 1, "pipe_partitioned": True, "grad_partitioned": True},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
AUTOTP = {"train_batch_size": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2},
          "tensor_parallel": {"autotp_size": 2, "tp_overlap_comm": False, "preset_model": "llama",
                              "partition_config": {"use_default_specs": True, "layer_specs": [
                                  {"patterns": [".*\\.o_proj\\.weight$"], "partition_type": "row"}]}}}
HF_AUTO = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupDecayLR"}, "zero_optimization": {"stage": 3}}
for _path in sorted(EXPECTED_AUTO):  # "auto" on every key the HF Trainer fills in, train_batch_size included
    HF_AUTO = nested(_path, "auto", HF_AUTO)


@pytest.mark.parametrize("cfg", [ZERO3_NVME, ZERO2_CPU, PIPELINE, AUTOTP, HF_AUTO],
                         ids=["z3-nvme", "z2-cpu", "pipe", "autotp", "hf-auto"])
def test_good_configs_pass_schema_and_deepspeed(cfg):
    assert errors(cfg) == []
    if cfg is not HF_AUTO:  # DeepSpeed itself cannot take "auto": the HF Trainer resolves it first
        dsc.DeepSpeedConfig(copy.deepcopy(cfg))


def test_every_default_together_passes_schema_and_deepspeed():
    def from_defaults(n):
        out = {k: from_defaults(s) if "properties" in s else s.get("default", MISSING)
               for k, s in n["properties"].items()}
        return {k: v for k, v in out.items() if v is not MISSING and v != {}}
    cfg = {k: v for k, v in from_defaults(SCHEMA).items() if k not in ("optimizer", "scheduler")}  # need a type
    cfg.update(train_batch_size=8)
    assert errors(cfg) == []
    dsc.DeepSpeedConfig(copy.deepcopy(cfg))


@pytest.mark.parametrize("path,value,needle", [
    ("gradient_clippping", 1.0, "gradient_clippping"), ("zero_optimization.stage", "auto", "zero_optimization.stage"),
    ("zero_optimization.reduce_bucket_size", 5.5, "reduce_bucket_size"), ("fp16.enabled", "true", "fp16.enabled"),
    ("zero_optimization.offload_param.device", "gpu", "device"), ("bf16.check_overflow", True, "check_overflow"),
    ("activation_checkpointing.partitioned_activations", True, "partitioned_activations"),  # the FORMAT doc's typo
    ("amp", {"enabled": True}, "amp"), ("zero_optimization.cpu_offload", True, "cpu_offload"),
    ("optimizer.params.lr", "fast", "optimizer.params.lr")])
def test_bad_configs_fail(path, value, needle):
    errs = errors(nested(path, value))
    assert errs and any(needle in e for e in errs), errs


def marked(kind):
    def walk(n, path):
        if "properties" in n:
            yield from [path] if n.get("x-deepspeed") == kind else []
            for k, sub in n["properties"].items():
                yield from walk(sub, f"{path}.{k}" if path else k)
    return set(walk(SCHEMA, ""))


def test_unknown_key_markers_match_what_deepspeed_does():
    """x-deepspeed "pydantic": DeepSpeed refuses an unknown key there (so does the harness); "dict": DeepSpeed ignores
    it (the harness warns, or refuses a near-miss of a known key); keys starting with "_" are comments there."""
    assert marked("pydantic") == set(PYDANTIC_BLOCKS)
    assert marked("dict") == {"", "optimizer", "optimizer.params", "scheduler", "scheduler.params", "pipeline",
                              *DICT_BLOCKS}
    base = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    for path in sorted(marked("pydantic") | marked("dict")):
        cfg = nested(f"{path}.zz_unknown_key" if path else "zz_unknown_key", 1, base)
        refusal = truth.refusal(lambda: dsc.DeepSpeedConfig(copy.deepcopy(cfg)))
        assert (refusal is not None and "zz_unknown_key" in refusal + str(cfg)) == (path in PYDANTIC_BLOCKS), path
        assert errors(cfg), path  # the schema still sees it (validate.py turns dict-level ones into warnings)
        comment = errors(nested(f"{path}._comment" if path else "_comment", "x", base))
        assert any("_comment" in e for e in comment) == (path in PYDANTIC_BLOCKS), path


def test_auto_in_a_pydantic_block_is_dropped_to_deepspeeds_default():
    """What harness/config/validate.py reports for an "auto" nobody fills: DeepSpeed drops it (strict=False) and uses
    the default, which the schema records; "stage": "auto" (ZeRO off) stays refused, the harness's stricter choice."""
    from harness.config.validate import normalize
    cfg = {"train_batch_size": 8, "zero_optimization": {
        "stage": 3, "stage3_max_live_parameters": "auto", "offload_param": {"device": "cpu", "buffer_size": "auto"}}}
    zero = dsc.DeepSpeedConfig(copy.deepcopy(cfg)).zero_config
    assert zero.max_live_parameters == node("zero_optimization.stage3_max_live_parameters")["default"]
    assert zero.offload_param.buffer_size == node("zero_optimization.offload_param.buffer_size")["default"]
    dropped, problems = normalize(cfg)
    assert dropped["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"}}
    assert [p.path for p in problems] == ["zero_optimization.stage3_max_live_parameters",
                                          "zero_optimization.offload_param.buffer_size"]
    assert all(p.severity == "warning" for p in problems) and "uses 1000000000" in problems[0].message
    assert dsc.DeepSpeedConfig(nested("zero_optimization.stage", "auto")).zero_optimization_stage == 0
    kept, problems = normalize(nested("zero_optimization.stage", "auto"))
    assert kept["zero_optimization"]["stage"] == "auto" and problems == []  # the schema refuses it


def test_optimizer_and_scheduler_lists_match_deepspeed_and_torch():
    """rules.py names what DeepSpeed builds from a config; kept equal to DeepSpeed's and torch's own lists."""
    import inspect

    import torch
    from deepspeed.runtime import lr_schedules
    from harness.config import rules
    assert list(rules.DS_OPTIMIZERS) == dsc.DEEPSPEED_OPTIMIZERS
    assert set(rules.TORCH_OPTIMIZERS) == {n for n, c in vars(torch.optim).items() if isinstance(c, type)
                                           and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
    assert list(rules.SCHEDULERS) == lr_schedules.VALID_LR_SCHEDULES
    for name, (accepted, required) in rules.SCHEDULERS.items():
        params = {k: p for k, p in inspect.signature(getattr(lr_schedules, name).__init__).parameters.items()
                  if k not in ("self", "optimizer", "last_batch_iteration")}
        assert set(params) == accepted and {k for k, p in params.items() if p.default is p.empty} == required, name
