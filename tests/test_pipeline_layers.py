"""The HF -> pipe conversion in one process (no ranks): the layer chain computes the HF model's logits and loss,
every HF weight has one pipe name; bad layouts exit 2 before any process group, with the arithmetic."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.errors import UsageError
from harness.model.hf import build_model
from harness.model.parallel import pipeline

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def qwen2_sliding():
    """Qwen2 with a sliding-window layer shorter than the sequence: the mask the pipe builds must be HF's."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                         use_sliding_window=True, sliding_window=8, max_window_layers=1,
                         attn_implementation="sdpa")
    torch.manual_seed(3)
    return AutoModelForCausalLM.from_config(config)


def mistral_sliding():
    from transformers import AutoModelForCausalLM, MistralConfig

    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                           attn_implementation="sdpa")
    torch.manual_seed(4)
    return AutoModelForCausalLM.from_config(config)


BUILDERS = {"qwen2-sliding": qwen2_sliding, "mistral-sliding": mistral_sliding}


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "qwen2-sliding", "mistral-sliding"])
def test_layer_chain_equals_the_hf_model(name):
    model = (BUILDERS[name]() if name in BUILDERS else build_model(name, seed=5)).eval()
    specs = pipeline.layer_specs(model)
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100
    x = ids
    with torch.no_grad():
        for spec in specs:
            module = spec.build()
            x = spec.forward_fn(module, x) if getattr(spec, "forward_fn", None) else module(x)
        want = model(input_ids=ids, labels=labels, use_cache=False)
        loss = pipeline.causal_lm_loss(x, labels)
    torch.testing.assert_close(x, want.logits, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss, want.loss, rtol=1e-6, atol=0)
    names = [n for layer in pipeline.hf_names(specs, model) for n in layer.values()]
    tied = {"lm_head.weight"} if pipeline._is_tied(model) else set()
    assert set(names) == set(model.state_dict()) - tied, "every HF weight must be exported from one pipe layer"


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "qwen2-sliding", "mistral-sliding"])
def test_layer_chain_keeps_documents_apart(name):
    """Document packing: (input_ids, position_ids) enter the first stage and reach every layer's attention, so
    the chain's logits are the HF model's with those position ids, and the second document's are its own alone."""
    model = (BUILDERS[name]() if name in BUILDERS else build_model(name, seed=5)).eval()
    with torch.no_grad():  # sharpen: a fresh model's logits barely depend on what it attends to
        for p in model.parameters():
            p.mul_(6) if p.dim() > 1 else None
    ids = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1)
    x = (ids, positions)
    with torch.no_grad():
        for spec in pipeline.layer_specs(model):
            module = spec.build()
            x = spec.forward_fn(module, x) if getattr(spec, "forward_fn", None) else module(x)
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        alone = model(input_ids=ids[:, 10:], use_cache=False).logits
        joined = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(x, packed, rtol=0, atol=1e-5)
    torch.testing.assert_close(x[:, 10:], alone, rtol=0, atol=1e-5)
    assert (joined[:, 10:] - alone).abs().max() > 1e-2  # without the documents the logits differ: the check bites


def test_partition_method_is_checked_against_the_layers():
    specs = pipeline.layer_specs(build_model("tiny-llama", seed=1))
    pipeline.check_partition_method("type:DecoderLayerPipe", specs)
    with pytest.raises(UsageError, match=r"'type:Transformer'.*\(EmbedPipe, DecoderLayerPipe, NormPipe, HeadPipe\)"):
        pipeline.check_partition_method("type:Transformer", specs)
    with pytest.raises(UsageError, match="expected parameters, uniform or type:<regex>"):
        pipeline.check_partition_method("best", specs)


def opt_folder(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "opt", "hidden_size": 64, "num_hidden_layers": 4,
                                                      "num_attention_heads": 4, "vocab_size": 512}))
    return str(tmp_path)


BAD_LAYOUTS = [
    (6, ["--recipe", "3d"], "pipeline 2 x tensor 2 = 4 does not divide the world size 6 (6 / 4 = 1.5 data-parallel"),
    (8, ["--recipe", "3d", "--set", "parallel.tensor=4"], "num_key_value_heads (2) of model tiny-llama must be "
                                                          "divisible by the tensor degree (4)"),
    (4, ["--recipe", "pipeline", "--set", "parallel.pipeline=4"], "4 pipeline stages for the 2 decoder layers of "
                                                                  "model tiny-llama: 4 > 2"),
    (2, ["--recipe", "pipeline", "--set", "zero.stage=2"], "DeepSpeed refuses ZeRO-2/3 with pipeline parallelism"),
    (2, ["--recipe", "pipeline", "--model", "OPT"], "model_type 'opt') cannot be split into pipeline stages; "
                                                    "supported model types: gpt2, llama, mistral, qwen2"),
]


@pytest.fixture(scope="module")
def bad_layout_runs(tmp_path_factory) -> dict:
    """harness/run.py's main on each bad layout, as the launcher would start it (WORLD_SIZE set, no RANK), every
    case in ONE interpreter (tests/drivers/catalogue.py: its own exit code and fd 1/2 per case)."""
    folder = tmp_path_factory.mktemp("layouts")
    cases = [{"id": str(i), "argv": [opt_folder(folder) if a == "OPT" else a for a in argv],
              "env": {"WORLD_SIZE": str(world), "RANK": None, "LOCAL_RANK": None}}
             for i, (world, argv, _) in enumerate(BAD_LAYOUTS)]
    (folder / "cases.json").write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, "tests/drivers/catalogue.py", str(folder / "cases.json"),
                           str(folder / "results.json")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((folder / "results.json").read_text())


@pytest.mark.parametrize("case, message", [(str(i), m) for i, (_, _, m) in enumerate(BAD_LAYOUTS)])
def test_bad_layouts_exit_2_before_launch(case, message, bad_layout_runs):
    got = bad_layout_runs[case]
    assert got["rc"] == 2, got["stderr"][-3000:]
    assert message in got["stderr"], got["stderr"]
    assert "Traceback" not in got["stderr"] and "Initializing TorchBackend" not in got["stderr"]


def test_resume_of_a_zero0_layout_on_another_is_refused(tmp_path):
    """A pipeline/tensor checkpoint moves to another layout through DeepSpeed's universal form
    (harness/checkpoint/relayout.py); the harness writes ZeRO-0's side of it only without tensor or pipeline
    parallelism (checkpoint/zero0.py): a pipeline x tensor ZeRO-0 save is refused before any rank starts, naming
    both layouts and the fix."""
    from harness.dist import ONE_PROCESS
    from harness.train import run_args, session

    ckpt = tmp_path / "checkpoints" / "global_step3"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text(json.dumps({"step": 3, "pp": 2, "tp": 2, "world_size": 4, "dp": 1}))
    (tmp_path / "checkpoints" / "latest").write_text("global_step3\n")
    args = run_args.parse(["--recipe", "zero1", "--output-dir", str(tmp_path), "--resume", "latest"])
    with pytest.raises(UsageError, match=r"saved on world 4 with pipeline 2, tensor 2, ZeRO-0; this launch is world "
                                         r"1 with pipeline 1, tensor 1, ZeRO-1: .*\(the saved side is pipeline 2, tensor 2, fp32\)"):
        session.prepare(args, ONE_PROCESS)
