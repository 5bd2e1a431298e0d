"""MoE folders read by the build by module (harness/model/load/experts.py): transformers 5.24 saves one tensor per
expert, the model holds fused gate_up_proj [E, 2I, H] / down_proj [E, H, I]. For a tiny folder of every family the
fused view holds exactly the model's keys (source.check_keys) and each tensor equals what from_pretrained loads,
read in one chunk or expert by expert; gpt-oss (stored fused) is read as stored; an incomplete expert set is named."""

from __future__ import annotations

import pytest
import torch

from helpers.moe_models import configs, folder

FAMILIES = sorted(configs())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_folders")
    return {fam: folder(fam, root / fam) for fam in FAMILIES}


@pytest.mark.parametrize("chunk", [64 << 20, 1])
@pytest.mark.parametrize("fam", FAMILIES)
def test_fused_view_equals_from_pretrained(folders, fam, chunk, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    from harness.model.load import experts, meta
    from harness.model.load.slices import Request
    from harness.model.load.source import CheckpointFiles, check_keys

    monkeypatch.setattr(experts, "CHUNK_BYTES", chunk)
    config = AutoConfig.from_pretrained(folders[fam])
    source = experts.fused_view(CheckpointFiles(folders[fam]), config)
    assert isinstance(source, experts.FusedExperts) == (fam != "gpt_oss")
    check_keys(source, meta.build_on_meta(config))
    want = AutoModelForCausalLM.from_pretrained(folders[fam], dtype=torch.float32).state_dict()
    got = source.read({key: Request() for key in source.keys()}, None)
    assert set(got) <= set(want) and {k for k in want if ".experts." in k} <= set(got)
    for key, tensor in got.items():
        assert torch.equal(tensor, want[key]), key
    if fam != "gpt_oss":
        gate_up = got["model.layers.1.mlp.experts.gate_up_proj"]
        raw = CheckpointFiles(folders[fam]).read({k: Request() for k in source.fused[
            "model.layers.1.mlp.experts.gate_up_proj"][3]}, None)
        assert torch.equal(gate_up[3], torch.cat(list(raw.values())))  # expert 3: gate rows, then up rows


def test_an_incomplete_expert_set_is_named(folders, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    from harness.model.load import experts
    from harness.model.load.source import CheckpointFiles

    state = load_file(f"{folders['qwen3_moe']}/model.safetensors")
    del state["model.layers.0.mlp.experts.2.up_proj.weight"]
    (tmp_path / "cut").mkdir()
    save_file(state, tmp_path / "cut" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts holds an incomplete set"):
        experts.fused_view(CheckpointFiles(tmp_path / "cut"), AutoConfig.from_pretrained(folders["qwen3_moe"]))
