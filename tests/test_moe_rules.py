"""MoE refusals: bad expert parallelism, tp or pipeline with a MoE model, a balancing loss where there is none, all
exit 2 from harness/run.py before any process group exists, with the values, the arithmetic and the fix. And the
AutoEP/transformers registry shim (harness/model/moe/compat.py): the test fails once either side changes."""

from __future__ import annotations

import inspect

import pytest

from harness.run import main
from helpers.moe_models import folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_rules")
    return {fam: folder(fam, root / fam) for fam in ("gpt_oss", "deepseek_v3", "olmoe")}


CASES = {  # name -> (model, world, sets, problem path, fragment of the message)
    "experts_not_divisible": ("tiny-qwen3-moe", 6, ["parallel.expert=3"], "parallel.expert",
                              "does not divide the 4 experts of tiny-qwen3-moe: 4 % 3 = 1"),
    "world_not_divisible": ("tiny-qwen3-moe", 3, ["parallel.expert=2"], "parallel.expert",
                            "does not divide the 3 data-parallel ranks (world 3): 3 % 2 = 1"),
    "gpt_oss_has_no_autoep_preset": ("gpt_oss", 2, ["parallel.expert=2"], "parallel.expert",
                                     "DeepSpeed AutoEP has no preset for gpt_oss"),
    "ep_with_tp": ("tiny-qwen3-moe", 4, ["parallel.expert=2", "parallel.tensor=2"], "parallel.tensor",
                   "tensor parallel splits llama, mistral, qwen2 decoder layers only"),  # the config layer's rule
    "moe_with_pipeline": ("tiny-qwen3-moe", 2, ["parallel.pipeline=2", "zero.stage=1", "moe.aux_loss=true"],
                          "parallel.pipeline", "cannot be split into pipeline stages"),  # the config layer's rule
    "olmoe_aux_under_ep": ("olmoe", 2, ["parallel.expert=2", "moe.aux_loss=true"], "moe.aux_loss",
                           "router-logit adapter matches Qwen2/3-MoE classes only"),
    "aux_without_aux_loss": ("deepseek_v3", 2, ["moe.aux_loss=true"], "moe.aux_loss",
                             "has no load-balancing loss"),
    "aux_coef_on_a_dense_model": ("tiny-llama", 2, ["moe.aux_loss_coef=0.01"], "moe.aux_loss", "has no router"),
    "ep_on_a_dense_model": ("tiny-llama", 2, ["parallel.expert=2"], "parallel.expert",
                            "is not a Mixture-of-Experts model"),
    "moe_with_sequence_parallel": ("tiny-qwen3-moe", 2, ["parallel.sequence=2", "zero.stage=3"], "parallel.sequence",
                                   "the router's balancing loss and the fused experts are not wired there"),
    "moe_with_tiled_loss": ("tiny-qwen3-moe", 2, ["train.tiled_loss=true"], "train.tiled_loss",
                            "the long-context path (harness/model/sequence)"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_before_any_rank_trains(name, folders, tmp_path, monkeypatch, capsys):
    import torch.distributed as dist

    model, world, sets, path, fragment = CASES[name]
    monkeypatch.setenv("WORLD_SIZE", str(world))
    argv = ["--recipe", "zero2", "--output-dir", str(tmp_path / "run"), "--set",
            f"train.model={folders.get(model, model)}"]
    for item in sets:
        argv += ["--set", item]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = next((ln for ln in err.splitlines() if ln.strip().startswith(path)), None)
    assert line is not None and fragment in err, err
    assert "fix:" in err
    assert not (tmp_path / "run").exists() and not (dist.is_available() and dist.is_initialized())


def test_ep_on_a_valid_layout_passes_the_checks(tmp_path):
    """The same checks let a valid EP 2 through, and fill AutoEP's preset for the family (not a refusal of all)."""
    from harness.dist import Launch
    from harness.train import run_args, session

    spec = session.prepare(run_args.parse(["--recipe", "zero2", "--output-dir", str(tmp_path / "run"),
                                           "--set", "train.model=tiny-mixtral", "--set", "parallel.expert=2"]),
                           Launch(world_size=2, local_size=2))
    assert spec.ds_config["expert_parallel"] == {"enabled": True, "autoep_size": 2, "preset_model": "mixtral",
                                                 "use_grouped_mm": False}


def test_registry_shim_is_still_needed_and_works():
    """DeepSpeed 0.19.8 calls the output-capture registry's dict get(key, default); transformers 5.24's
    _CanRecordRegistry.get takes a model only. When DeepSpeed stops calling it so, or transformers accepts a
    default, this test fails: drop harness/model/moe/compat.py then."""
    from deepspeed.module_inject.auto_ep_presets import base
    from transformers.utils import output_capturing

    from harness.model.moe import compat

    assert "registry.get(registry_key, _MISSING_REGISTRY_ENTRY)" in inspect.getsource(
        base._install_instance_transformers_output_recorders), "DeepSpeed's call changed: is the shim still needed?"
    registry_cls = output_capturing._CanRecordRegistry
    if not getattr(registry_cls.get, compat._PATCHED, False):  # this process has not patched it yet
        with pytest.raises(TypeError):
            registry_cls().get("key", None)
        assert list(inspect.signature(registry_cls.get).parameters) == ["self", "model"], \
            "transformers' get changed: is the shim still needed?"
    compat.patch_output_capture_registry()
    assert compat.patch_output_capture_registry() is False  # once per process
    registry = registry_cls()
    missing = object()
    assert registry.get("key", missing) is missing
    registry.update({"key": {"router_logits": 1}})
    assert registry.get("key", missing) == {"router_logits": 1}

    class Model:
        pass

    registry[Model()] = {"hidden_states": 2}  # transformers' own one-argument use keeps its meaning
    assert registry.get(Model()) == {"hidden_states": 2}


@pytest.mark.parametrize("family, leaf, preset", [
    ("mixtral", "MixtralSparseMoeBlock", "mixtral"), ("qwen2_moe", "Qwen2MoeSparseMoeBlock", "qwen3_moe"),
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "qwen3_moe"), ("olmoe", "OlmoeSparseMoeBlock", "qwen3_moe"),
    ("deepseek_v3", "DeepseekV3MoE", "deepseek_v3"), ("gpt_oss", "GptOssMLP", None)])
def test_leaf_table_names_each_familys_moe_block(family, leaf, preset):
    """The table's leaf class is the module that holds the family's experts and router in transformers, and the
    wiring writes it (and the AutoEP preset) into the DeepSpeed config, keeping a leaf_module the config names."""
    import torch
    from transformers import AutoModelForCausalLM

    from harness.config import moe_families
    from harness.model.moe.wiring import engine_blocks
    from helpers.moe_models import configs

    config = configs()[family]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    fam = moe_families.family_of(config)
    blocks = [m for m in model.modules() if type(m).__name__ == leaf]
    assert blocks and all(hasattr(b, fam.experts) and hasattr(b, fam.router) for b in blocks)
    assert type(getattr(blocks[0], fam.router)).__name__ == fam.router_class
    assert moe_families.num_experts(fam, config.to_dict()) == 4
    ds = engine_blocks({"zero_optimization": {"stage": 3}, "expert_parallel": {"enabled": True, "autoep_size": 2}},
                       config, cuda=True)
    assert ds["zero_optimization"]["leaf_module"] == {"classes": [leaf]}
    assert ds["expert_parallel"]["preset_model"] == preset and ds["expert_parallel"]["use_grouped_mm"] is True
    own = {"zero_optimization": {"stage": 3, "leaf_module": {"names": ["x"]}}}
    assert engine_blocks(own, config, cuda=False)["zero_optimization"]["leaf_module"] == {"names": ["x"]}
