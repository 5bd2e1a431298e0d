"""MoE checkpoints, export and LoRA on experts, on real DeepSpeed ranks (tiny-qwen3-moe: 4 fused experts, top 2, fp32).

One 2-rank launch runs every job in one process group (tests/drivers/jobs.py): ZeRO-2 and ZeRO-3 (the family's leaf
table) full fine-tuning with a resume from step 3 each, AutoEP (parallel.expert=2, ZeRO-2 and ZeRO-3), LoRA on attention + the fused experts (peft
target_parameters) on ZeRO-2 with the router frozen, and on ZeRO-3 with adapter.train_router. Asserted: exact
resume, exported folders (transformers' fused layout, AutoEP included) equal to the engine's weights and loading
in AutoModelForCausalLM with the engine's logits, LoRA parity with one peft process (losses and final adapters),
exact resume across expert-parallel degrees (EP 2 -> EP 1 and EP 1 -> EP 2 through the universal form; on ZeRO-3 in
tests/test_relayout.py, the refusals in tests/test_checkpoint_files.py).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers.baseline import plain_pytorch_losses
from helpers.export_checks import assert_export_equals_engine, read_sharded
from helpers.launch import launch_jobs, losses
from helpers.parity import COMMON, assert_close

pytestmark = pytest.mark.multirank

MODEL, STEPS, SEED, LR, RTOL = "tiny-qwen3-moe", 6, 1234, 1e-3, 1e-5
# Weights after 6 Adam steps at lr 1e-3 from two fp32 paths (another reduction order): Adam's m / sqrt(v) turns the
# rounding of near-zero gradients into up to ~2e-5 of weight (measured: adapters 4.5e-6 on concat rows, 1.6e-5 on
# document-packed rows; EP 2 vs ZeRO-2 3.6e-6); a wrong layout or a lost update is off by ~1e-3 (one step).
ADAM_ATOL = 1e-4
BASE = [*COMMON[:COMMON.index("--profile-steps")], "--set", "precision=fp32", "--set", f"train.model={MODEL}"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA = ["--set", f"adapter.target_modules={json.dumps(ATTENTION)}",
        "--set", f"adapter.target_parameters={json.dumps(EXPERTS)}"]


def _cases(root) -> list[list[str]]:
    step3 = lambda name: str(root / name / "checkpoints" / "global_step3")  # noqa: E731
    return [
        ["--recipe", "zero2", "--output-dir", str(root / "zero2"), *BASE],
        ["--recipe", "zero2", "--output-dir", str(root / "zero2_resumed"), "--resume", step3("zero2"), *BASE],
        ["--recipe", "zero3", "--output-dir", str(root / "zero3"), *BASE],
        ["--recipe", "zero3", "--output-dir", str(root / "zero3_resumed"), "--resume", step3("zero3"), *BASE],
        ["--recipe", "lora_zero2", "--output-dir", str(root / "lora_zero2"), *BASE, *LORA],
        ["--recipe", "lora_zero3", "--output-dir", str(root / "lora_zero3_router"), *BASE, *LORA,
         "--set", "adapter.train_router=true"],
        ["--recipe", "zero2", "--output-dir", str(root / "ep2"), *BASE, "--set", "parallel.expert=2"],
        ["--recipe", "zero3", "--output-dir", str(root / "ep2_zero3"), *BASE, "--set", "parallel.expert=2"],
        # another expert degree: through the universal form, its experts rewritten (checkpoint/expert_layout.py)
        ["--recipe", "zero2", "--output-dir", str(root / "ep2_to_ep1"), "--resume", step3("ep2"), *BASE],
        ["--recipe", "zero2", "--output-dir", str(root / "ep1_to_ep2"), "--resume", step3("zero2"), *BASE,
         "--set", "parallel.expert=2"],
    ]


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """The launch's output; the cases run in order and a failing one ends the launch, so each test checks that
    its own runs finished (and shows the launch's output if not)."""
    root = tmp_path_factory.mktemp("moe_ckpt")
    proc = launch_jobs(_cases(root), root, check=False)
    return root, proc


def finished(launched, *names: str):
    """The launch's folder, once the runs `names` completed (else the launch's output, to see why)."""
    root, proc = launched
    missing = [n for n in names if not (root / n / "checkpoints" / "latest").is_file()]
    assert not missing, f"runs that did not finish: {missing}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return root


def _adapter(**extra) -> dict:
    from harness.config.recipes import load_recipe

    return {**load_recipe("lora_zero2")[0]["adapter"], "target_modules": ATTENTION, "target_parameters": EXPERTS,
            **extra}


def _reference(adapter: dict, trained: dict) -> list[float]:
    return plain_pytorch_losses(model=MODEL, steps=STEPS, seq_len=64, global_batch=8, lr=LR, betas=(0.9, 0.999),
                                eps=1e-8, weight_decay=0.01, clip=1.0, seed=SEED, eval_fraction=0.02,
                                adapter=adapter, trained=trained)


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_exact_resume(launched, name):
    root = finished(launched, name, f"{name}_resumed")
    straight, resumed = losses(root / name), losses(root / f"{name}_resumed")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == straight[s] for s in (4, 5, 6)), f"{resumed} vs {straight}"


@pytest.mark.parametrize("name", ["zero2", "zero3"])
def test_export_is_the_engine_s_weights_in_the_fused_layout(launched, name, tmp_path):
    root = finished(launched, name)
    info = assert_export_equals_engine(root / name, tmp_path / "hf")
    assert info["max_logit_diff"] <= 1e-5, info
    names = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)


def test_autoep_export_gathers_the_expert_files(launched, tmp_path):
    """The per-expert files of an EP 2 checkpoint fused back into [E, 2I, H] / [E, H, I] (gate rows first), the
    router under its HF name; the folder loads with the engine's logits and matches the ZeRO-2 run's export
    (the same training on the same data, fp32)."""
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.export.folder import export

    root = finished(launched, "ep2", "zero2")
    info = export(root / "ep2", tmp_path / "ep", max_shard_size="64KB")
    assert info["max_logit_diff"] <= 1e-5 and info["shards"] > 1, info
    got = dict(read_sharded(tmp_path / "ep"))
    tag = root / "ep2" / "checkpoints" / "global_step6"
    one = torch.load(tag / "layer_1_expert_3_mp_rank_00_model_states.pt", weights_only=True)
    prefix = "model.layers.1.mlp.experts"
    assert torch.equal(got[f"{prefix}.gate_up_proj"][3], torch.cat([one[f"{prefix}.w1.3"], one[f"{prefix}.w3.3"]]))
    assert torch.equal(got[f"{prefix}.down_proj"][3], one[f"{prefix}.w2.3"])
    export(root / "zero2", tmp_path / "z2", max_shard_size="64KB")
    dense = dict(read_sharded(tmp_path / "z2"))
    assert set(got) == set(dense)
    for key, tensor in dense.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=ADAM_ATOL)
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "ep").model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4


def test_autoep_zero3_export_gathers_the_expert_partitions(launched, tmp_path):
    """AutoEP on ZeRO-3 writes no per-expert files: each rank's fp32 partitions hold its ep rank's experts. The
    export gathers them into [E, 2I, H] / [E, H, I]; the folder loads with the engine's logits (probe) and equals
    the same training's EP 2 ZeRO-2 export (DeepSpeed's own per-expert files) and ZeRO-3 export, to Adam's
    rounding (fp32)."""
    from transformers import AutoModelForCausalLM

    from harness.checkpoint.export.folder import export

    root = finished(launched, "ep2_zero3", "ep2", "zero3")
    tag = root / "ep2_zero3" / "checkpoints" / "global_step6"
    assert not list(tag.glob("layer_*_expert_*")) and len(list(tag.glob("zero_pp_rank_*_optim_states.pt"))) == 2
    info = export(root / "ep2_zero3", tmp_path / "ep", max_shard_size="64KB")
    assert info["max_logit_diff"] <= 1e-5 and info["shards"] > 1, info
    got = dict(read_sharded(tmp_path / "ep"))
    for other in ("ep2", "zero3"):
        export(root / other, tmp_path / other, max_shard_size="64KB")
        want = dict(read_sharded(tmp_path / other))
        assert set(got) == set(want)
        for key, tensor in want.items():
            torch.testing.assert_close(got[key], tensor, rtol=0, atol=ADAM_ATOL, msg=f"{other}: {key}")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ep")
    assert model.model.layers[1].mlp.experts.gate_up_proj.shape == got["model.layers.1.mlp.experts.gate_up_proj"].shape


@pytest.mark.parametrize("name,router", [("lora_zero2", False), ("lora_zero3_router", True)])
def test_expert_lora_matches_one_peft_process(launched, name, router, tmp_path):
    """Losses and the final adapters (A and B of every attention projection and fused expert tensor; the router
    where trained) equal one process training the same peft model with torch AdamW; the router stays frozen unless
    adapter.train_router; the adapter folder loads with plain peft and the merged folder with transformers, both
    with the engine's logits."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from harness.checkpoint.export.folder import export
    from harness.model import adapters
    from harness.model.hf import build_model

    root = finished(launched, name)
    trained: dict = {}
    worst = assert_close(losses(root / name), _reference(_adapter(train_router=router), trained), RTOL)
    info = export(root / name, tmp_path / "adapter", adapter_only=True)
    assert info["max_logit_diff"] <= 1e-5, info
    got = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    want = {adapters.peft_key(k): v for k, v in trained.items()}
    assert set(got) == set(want), sorted(set(got) ^ set(want))[:6]
    assert sum(".experts." in k for k in got) == 2 * 2 * 2  # A, B x gate_up, down x 2 layers
    assert any(".mlp.gate." in k for k in got) == router
    for key, tensor in want.items():
        torch.testing.assert_close(got[key], tensor, rtol=0, atol=ADAM_ATOL)
    base = build_model(MODEL, seed=SEED).float().eval()
    routers = {k: v.clone() for k, v in base.state_dict().items() if k.endswith("mlp.gate.weight")}
    merged = export(root / name, tmp_path / "merged", max_shard_size="64KB")
    assert merged["max_logit_diff"] <= 1e-5, merged
    peft_merged = PeftModel.from_pretrained(base, tmp_path / "adapter").merge_and_unload().state_dict()
    for key, tensor in read_sharded(tmp_path / "merged"):
        torch.testing.assert_close(tensor, peft_merged[key], rtol=1e-6, atol=1e-6, msg=key)
        if key in routers:
            assert torch.equal(tensor, routers[key]) != router, f"{key}: trained={router}"
    gate_up = "model.layers.0.mlp.experts.gate_up_proj"
    assert not torch.equal(peft_merged[gate_up], build_model(MODEL, seed=SEED).state_dict()[gate_up])
    print(f"moe expert lora {name}: max relative loss difference vs one peft process {worst:.2e}")


def _train(run_dir) -> dict[int, tuple[float, float]]:
    from helpers.launch import records

    return {r["step"]: (r["loss"], r["grad_norm"]) for r in records(run_dir, "train")}


@pytest.mark.parametrize("name,source,straight,form", [("ep2_to_ep1", "ep2", "ep2", "transformers"),
                                                       ("ep1_to_ep2", "zero2", "zero2", "autoep")])
def test_resume_on_another_expert_degree(launched, name, source, straight, form):
    """Step 3 of an EP 2 run resumed on EP 1 (and of an EP 1 run on EP 2) continues the uninterrupted run: losses and
    grad norms of steps 4-6 within 1e-6 relative (measured: losses equal, grad norms 1e-7), so the fp32 weights and
    both Adam moments of every fused expert came across; the universal folder's experts are in the loading side's
    layout (gate_up_proj/down_proj for EP 1, AutoEP's w1/w2/w3 for EP 2)."""
    root = finished(launched, name, source, straight)
    resumed, reference = _train(root / name), _train(root / straight)
    assert sorted(resumed) == [4, 5, 6]
    for step, (loss, norm) in resumed.items():
        assert loss == pytest.approx(reference[step][0], rel=1e-6), (step, resumed, reference)
        assert norm == pytest.approx(reference[step][1], rel=1e-6), (step, resumed, reference)
    universal = root / source / "checkpoints" / "universal" / "global_step3"
    assert json.loads((universal / "converted.json").read_text())["experts"] == form
    names = {p.name for p in (universal / "zero").iterdir()}
    fused = {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.gate.weight"}
    grouped = {"model.layers.0.mlp.experts.w1", "model.layers.0.mlp.experts.w3",
               "model.layers.0.mlp.router.gate.weight"}
    assert (fused, grouped)[form == "autoep"] <= names and not (grouped, fused)[form == "autoep"] & names


def test_universal_expert_rewrite_is_exact_and_its_own_inverse(launched, tmp_path):
    """The EP 2 checkpoint's universal form, rewritten to transformers' layout (by the EP 1 resume) and back to
    AutoEP's here, equals DeepSpeed's own conversion bit for bit (every state file of every parameter, and the
    optimizer's param groups); its gate_up_proj holds w1 rows then w3 rows."""
    from harness.checkpoint import resume, expert_layout
    from harness.config import moe_families

    root = finished(launched, "ep2_to_ep1")
    rewritten = root / "ep2" / "checkpoints" / "universal" / "global_step3"
    fresh = tmp_path / "global_step3"
    resume._convert(root / "ep2" / "checkpoints" / "global_step3", tmp_path, fresh)
    gate_up = torch.load(rewritten / "zero" / "model.layers.1.mlp.experts.gate_up_proj" / "exp_avg.pt")["param"]
    w1, w3 = (torch.load(fresh / "zero" / f"model.layers.1.mlp.experts.{w}" / "exp_avg.pt")["param"]
              for w in ("w1", "w3"))
    assert torch.equal(gate_up, torch.cat([w1, w3], dim=1))
    back = tmp_path / "back"
    shutil.copytree(rewritten, back)
    family = moe_families.FAMILIES["qwen3_moe"]
    assert expert_layout.rewrite(back, {"experts": "transformers"}, family, 2) == ("transformers", "autoep", 2)
    want = sorted(p.relative_to(fresh) for p in (fresh / "zero").rglob("*.pt"))
    assert sorted(p.relative_to(back) for p in (back / "zero").rglob("*.pt")) == want
    for rel in want:
        a, b = torch.load(back / rel, weights_only=False), torch.load(fresh / rel, weights_only=False)
        if rel.name == "optimizer_state.pt":  # spare expert groups (DeepSpeed may cut experts in several)
            groups = [[{k: v for k, v in g.items() if k != "params"} for g in x["param_groups"]] for x in (a, b)]
            assert groups[0][:len(groups[1])] == groups[1] and all(g == groups[1][-1] for g in groups[0][1:])
        elif isinstance(a, dict):
            assert set(a) == set(b) and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                            for k in a), rel
        else:
            assert a == b, rel
