"""`harness validate | show | recipes | build` through the real CLI entry point, main(argv) -> int."""
import json
import shutil
from pathlib import Path

import pytest

from harness.cli import main
from harness.config.recipes import ROOT_ENV, recipe_names

REPO = Path(__file__).resolve().parents[1]
RECIPES = ["3d", "ddp", "long_context", "lora_zero2", "lora_zero3", "moe_ep", "moe_zero3", "pipeline", "tp", "zero1",
           "zero2", "zero2_bf16_sr", "zero2_bf16_states", "zero2_muon", "zero2_offload", "zero3", "zero3_nvme",
           "zero3_offload"]

# What an Axolotl / LLaMA-Factory ZeRO-3 preset looks like: everything the HF Trainer would fill is "auto".
HF_STYLE_ZERO3 = {
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
}
# recipe defaults (recipe.schema.json) and tiny-llama (hidden_size 64): what each "auto" becomes, and from where
HF_FILLED = {
    "train_micro_batch_size_per_gpu": (4, "recipe batch.micro_batch_per_gpu"),
    "gradient_accumulation_steps": (1, "recipe batch.grad_accum_steps"),
    "train_batch_size": (32, "micro 4 x accum 1 x world 8"),
    "gradient_clipping": (1.0, "recipe gradient_clipping"),
    "optimizer.params.lr": (3e-4, "recipe optimizer.lr"),
    "optimizer.params.betas": ([0.9, 0.95], "recipe optimizer.betas"),
    "optimizer.params.eps": (1e-8, "recipe optimizer.eps"),
    "optimizer.params.weight_decay": (0.01, "recipe optimizer.weight_decay"),
    "scheduler.params.warmup_min_lr": (0.0, "default 0"),
    "scheduler.params.warmup_max_lr": (3e-4, "recipe optimizer.lr"),
    "scheduler.params.warmup_num_steps": (10, "recipe scheduler.warmup_steps"),
    "scheduler.params.total_num_steps": (101, "recipe train.steps + 1"),
    "bf16.enabled": (True, "recipe precision 'bf16'"),
    "zero_optimization.reduce_bucket_size": (64 * 64, "model tiny-llama hidden_size=64: hidden_size^2"),
    "zero_optimization.stage3_prefetch_bucket_size": (3686, "model tiny-llama hidden_size=64: 0.9 x hidden_size^2"),
    "zero_optimization.stage3_param_persistence_threshold": (640, "model tiny-llama hidden_size=64: 10 x hidden_size"),
}


def write(tmp_path: Path, name: str, data) -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data, indent=2))
    return str(path)


def run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def get(d: dict, dotted: str):
    for key in dotted.split("."):
        d = d[key]
    return d


def test_typo_gradient_clippping_names_it_and_suggests_the_key(tmp_path, capsys):
    path = write(tmp_path, "ds.json", {"train_batch_size": 8, "gradient_clippping": 1.0})
    code, out, err = run(["validate", path], capsys)
    assert code == 2
    assert "gradient_clippping: unknown key 'gradient_clippping'" in err
    assert "did you mean 'gradient_clipping'?" in err
    assert out == ""


def test_hf_style_auto_config_validates_for_world_8(tmp_path, capsys):
    path = write(tmp_path, "hf_zero3.json", HF_STYLE_ZERO3)
    code, out, err = run(["validate", path, "--world-size", "8", "--model", "tiny-llama"], capsys)
    assert (code, err) == (0, "")
    assert out == f"{path}: valid for world size 8\n"
    # without --model: still valid; the hidden-size autos are filled at launch, and a note says so
    code, out, err = run(["validate", path, "--world-size", "8"], capsys)
    assert (code, out) == (0, f"{path}: valid for world size 8\n")
    notes = [line for line in err.splitlines() if not line.startswith("    fix: ")]
    assert len(notes) == 3 and all(line.startswith(f"note: {path}:zero_optimization.") for line in notes), err


def test_without_model_model_checks_are_skipped_not_run_on_a_default(tmp_path, capsys):
    """autotp_size 4 is fine for a model with 4 kv heads; the default tiny-llama (2) must not decide it."""
    path = write(tmp_path, "tp4.json", {"train_batch_size": 16, "tensor_parallel": {"autotp_size": 4}})
    code, out, err = run(["validate", path, "--world-size", "8"], capsys)
    assert code == 0 and "valid for world size 8" in out
    assert "note: " in err and "pipeline 1 x tensor 4 was not checked" in err and "pass --model" in err
    code, _, err = run(["validate", path, "--world-size", "8", "--model", "tiny-llama"], capsys)
    assert code == 2 and "num_key_value_heads (2) of model tiny-llama must be divisible by the tensor degree (4)" in err


def test_what_deepspeed_ignores_warns_and_a_near_miss_is_refused(tmp_path, capsys):
    cfg = {"_comment": "JSON has no comments", "train_batch_size": 16, "cuda_visible_devices": 0,
           "hybrid_engine": {"enabled": False}, "zero_optimization": {"stage": 3, "stage3_max_live_parameters": "auto"},
           "autotuning": {"enabled": True, "fast": False}, "data_efficiency": {"enabled": False}}
    path = write(tmp_path, "ignored.json", cfg)
    code, out, err = run(["validate", path, "--world-size", "8"], capsys)
    assert code == 0 and "valid for world size 8" in out
    flagged = {line.split(".json:")[1].split(":")[0] for line in err.splitlines() if line.startswith("warning: ")}
    assert flagged == {"cuda_visible_devices", "hybrid_engine", "zero_optimization.stage3_max_live_parameters"}, err
    assert f"warning: {path}:cuda_visible_devices: unknown key 'cuda_visible_devices': DeepSpeed ignores it" in err
    assert f"warning: {path}:hybrid_engine: 'hybrid_engine' is read by DeepSpeed but not checked" in err
    assert (f'warning: {path}:zero_optimization.stage3_max_live_parameters: "auto" here is filled by neither the '
            "HF Trainer nor accelerate: DeepSpeed drops it and uses 1000000000") in err
    cfg = {"train_batch_size": 16, "zero_optimization": {"stage": 2, "_comment": "x"}, "gradient_clippping": 1.0}
    code, _, err = run(["validate", write(tmp_path, "refused.json", cfg)], capsys)
    assert code == 2 and "zero_optimization._comment: unknown key '_comment'" in err  # DeepSpeed refuses it there
    assert "gradient_clippping: unknown key 'gradient_clippping': DeepSpeed silently ignores it" in err


def test_optimizer_max_grad_norm_is_refused_as_deepspeed_does(tmp_path, capsys):
    cfg = {"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "max_grad_norm": 0.5}}}
    code, _, err = run(["validate", write(tmp_path, "mgn.json", cfg)], capsys)
    assert code == 2
    assert "optimizer.params.max_grad_norm: DeepSpeed refuses max_grad_norm as an optimizer parameter" in err
    assert 'fix: remove it and set the top-level "gradient_clipping": 0.5' in err


def test_show_fills_every_auto_and_says_where_each_value_came_from(tmp_path, capsys):
    path = write(tmp_path, "hf_zero3.json", HF_STYLE_ZERO3)
    code, out, err = run(["show", path, "--world-size", "8", "--model", "tiny-llama"], capsys)
    assert code == 0
    shown = json.loads(out)
    assert '"auto"' not in json.dumps(shown)
    assert shown["zero_optimization"]["sub_group_size"] == 1e9  # values that were not "auto" are kept
    lines = {line.split("=")[0].strip(): line for line in err.splitlines()[1:]}
    assert err.splitlines()[0] == "filled values:"
    assert set(lines) == set(HF_FILLED)
    for key, (value, source) in HF_FILLED.items():
        assert get(shown, key) == pytest.approx(value), key
        assert lines[key].endswith(f"<- {source}"), lines[key]
        assert f"= {json.dumps(value)}" in lines[key]


def test_show_of_a_recipe_with_auto_batch_records_the_arithmetic(capsys):
    code, out, err = run(["show", "zero2_offload", "--world-size", "8"], capsys)
    assert code == 0
    shown = json.loads(out)
    assert (shown["train_batch_size"], shown["train_micro_batch_size_per_gpu"],
            shown["gradient_accumulation_steps"]) == (256, 8, 4)
    assert "train_micro_batch_size_per_gpu = 8" in " ".join(err.split())
    assert "<- batch 256 / (accum 4 x world 8)" in err
    assert "<- model tiny-llama hidden_size=64: hidden_size^2" in err


def test_deprecated_keys_warn_remap_and_pass(tmp_path, capsys):
    cfg = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
           "zero_optimization": {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True,
                                 "cpu_offload_param": True}}
    path = write(tmp_path, "old.json", cfg)
    code, out, err = run(["validate", path, "--world-size", "8"], capsys)
    assert code == 0
    assert f"{path}: valid for world size 8" in out
    assert ("warning: " + f"{path}:zero_optimization.stage3_gather_fp16_weights_on_model_save: deprecated key, "
            "remapped to zero_optimization.stage3_gather_16bit_weights_on_model_save") in err
    assert "zero_optimization.cpu_offload_param: deprecated key, remapped to zero_optimization.offload_param" in err

    code, out, err = run(["show", path, "--world-size", "8"], capsys)
    assert code == 0
    zero = json.loads(out)["zero_optimization"]
    assert zero["stage3_gather_16bit_weights_on_model_save"] is True
    assert zero["offload_param"] == {"device": "cpu"}
    assert "stage3_gather_fp16_weights_on_model_save" not in zero and "cpu_offload_param" not in zero
    assert "warning: " in err


def test_deprecated_key_in_a_recipe_names_the_recipe_key(tmp_path, capsys):
    recipe = {"description": "zero3 with an old key", "zero": {"stage": 3},
              "deepspeed": {"zero_optimization": {"stage3_gather_fp16_weights_on_model_save": True}}}
    code, out, err = run(["validate", write(tmp_path, "r.json", recipe)], capsys)
    assert code == 0
    assert ":deepspeed.zero_optimization.stage3_gather_fp16_weights_on_model_save: deprecated key" in err


def test_every_problem_is_reported_at_once(tmp_path, capsys):
    cfg = {"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
           "gradient_clippping": 1.0, "fp16": {"enabled": True}, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}
    path = write(tmp_path, "three.json", cfg)
    code, _, err = run(["validate", path, "--world-size", "8"], capsys)
    assert code == 2
    assert err.startswith(f"{path}: 4 problems\n"), err
    for line in ("  gradient_clippping: unknown key", "  fp16.enabled: fp16 and bf16 are both enabled",
                 "  zero_optimization.offload_param: offload_param (device 'cpu') with stage 1",
                 "  train_batch_size: train_batch_size 64 != micro 4 x accum 1 x world 8 = 32"):
        assert line in err


def test_every_problem_in_a_recipe_is_reported_at_once(tmp_path, capsys):
    recipe = {"description": "three mistakes", "precision": "bf61", "zeroo": {}, "train": {"stepz": 3}}
    code, _, err = run(["validate", write(tmp_path, "r.json", recipe)], capsys)
    assert code == 2
    assert ": 3 problems\n" in err
    assert "  precision: " in err and "  zeroo: " in err and "  train.stepz: " in err
    assert "did you mean 'steps'?" in err


def test_recipes_lists_every_recipe_with_its_description(capsys):
    code, out, _ = run(["recipes"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == RECIPES == recipe_names()
    assert all(len(line.split(None, 1)[1]) > 40 for line in lines), "each recipe needs a real description"


def test_recipes_keys_lists_every_key_with_default(capsys):
    code, out, _ = run(["recipes", "--keys"], capsys)
    assert code == 0
    assert any(line.startswith("zero.stage ") for line in out.splitlines())
    assert any(line.startswith("batch.micro_batch_per_gpu ") for line in out.splitlines())


def test_show_unknown_recipe_lists_valid_ones(capsys):
    code, out, err = run(["show", "zero4", "--world-size", "8"], capsys)
    assert code == 2
    assert out == ""
    assert "unknown recipe 'zero4'" in err
    assert "valid recipes: " + ", ".join(RECIPES) in err


@pytest.mark.parametrize("name", RECIPES)
def test_show_every_recipe_for_world_8(name, capsys):
    code, out, err = run(["show", name, "--world-size", "8"], capsys)
    assert code == 0
    assert '"auto"' not in json.dumps(json.loads(out))
    assert err.startswith("filled values:")


def test_show_set_override_with_unknown_key_is_a_usage_error(capsys):
    code, out, err = run(["show", "zero2", "--world-size", "8", "--set", "zero.stag=3"], capsys)
    assert code == 2 and out == ""
    assert "--set zero.stag: not a recipe key (did you mean 'zero.stage'?)" in err


def test_show_set_override_that_breaks_a_rule_names_it(capsys):
    code, _, err = run(["show", "zero2", "--world-size", "8", "--set", "zero.offload_param=cpu"], capsys)
    assert code == 2
    assert "zero.offload_param (-> zero_optimization.offload_param): offload_param (device 'cpu') with stage 2" in err


def test_validate_missing_file_and_bad_arguments(tmp_path, capsys):
    code, _, err = run(["validate", str(tmp_path / "nope.json")], capsys)
    assert code == 2 and "nope.json: no such file" in err
    code, _, err = run(["validate", str(tmp_path / "nope.json"), "--world-size", "0"], capsys)
    assert code == 2 and "--world-size: '0': expected a number of ranks >= 1" in err
    code, _, err = run(["validate"], capsys)
    assert code == 2 and "the following arguments are required: FILE" in err
    code, _, err = run(["frobnicate"], capsys)
    assert code == 2 and "invalid choice: 'frobnicate'" in err


def test_shipped_recipes_and_configs_validate_for_world_8(capsys):
    files = sorted(str(p) for d in ("recipes", "ds_configs") for p in (REPO / d).glob("*.json"))
    code, out, err = run(["validate", *files, "--world-size", "8"], capsys)
    assert code == 0 and "warning" not in err
    assert all(line.startswith(("note: ", "    fix: ")) for line in err.splitlines())  # ds_configs/ name no model
    assert out.count("valid for world size 8") == 2 * len(RECIPES)


# --- harness build [--check], on a copy of the repo's recipes/ and ds_configs/ ---

@pytest.fixture
def repo_copy(tmp_path, monkeypatch):
    for folder in ("recipes", "ds_configs"):
        shutil.copytree(REPO / folder, tmp_path / folder)
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    return tmp_path


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.json"))}


def test_build_check_passes_on_the_repo(capsys):
    before = snapshot(REPO / "ds_configs")
    code, out, err = run(["build", "--check"], capsys)
    assert code == 0, err
    assert out == f"ds_configs/ in sync with recipes/ ({len(RECIPES)} files)\n"
    assert snapshot(REPO / "ds_configs") == before


def test_build_check_fails_when_a_generated_file_is_edited(repo_copy, capsys):
    real = snapshot(REPO / "ds_configs")
    edited = repo_copy / "ds_configs" / "zero2.json"
    edited.write_text(edited.read_text().replace('"stage": 2', '"stage": 3'))
    (repo_copy / "ds_configs" / "orphan.json").write_text("{}\n")
    code, out, err = run(["build", "--check"], capsys)
    assert code == 1
    assert "out of date: ds_configs/zero2.json" in err
    assert "no recipe for: ds_configs/orphan.json" in err
    assert '"stage": 3' in edited.read_text(), "--check writes nothing"

    code, out, err = run(["build"], capsys)  # regenerates the copy
    assert code == 0
    assert "wrote ds_configs/zero2.json" in out and "removed ds_configs/orphan.json (no recipe)" in out
    assert snapshot(repo_copy / "ds_configs") == real
    assert run(["build", "--check"], capsys)[0] == 0
    assert snapshot(REPO / "ds_configs") == real, "the repo's own ds_configs/ must never be touched"


def test_build_check_fails_when_a_recipe_changes(repo_copy, capsys):
    recipe = repo_copy / "recipes" / "zero1.json"
    recipe.write_text(recipe.read_text().replace('"stage": 1', '"stage": 2'))
    code, _, err = run(["build", "--check"], capsys)
    assert code == 1
    assert "out of date: ds_configs/zero1.json" in err


def test_build_refuses_an_invalid_recipe(repo_copy, capsys):
    (repo_copy / "recipes" / "broken.json").write_text('{"description": "x", "zero": {"stage": 2, '
                                                       '"offload_param": "cpu"}}')
    code, _, err = run(["build", "--check"], capsys)
    assert code == 2
    assert "broken.json: 1 problem" in err and "zero.offload_param (-> zero_optimization.offload_param)" in err


def test_build_with_a_root_without_recipes_is_an_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(ROOT_ENV, str(tmp_path))
    code, _, err = run(["build", "--check"], capsys)
    assert code == 2
    assert f"no recipes in {tmp_path / 'recipes'}" in err
