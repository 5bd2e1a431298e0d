"""Loading by share (harness/model/load) and the training dtype honoured.

In process: a bf16 Llama folder in several safetensors files + index; each tensor-parallel rank's slices read
through the index equal the slices of the whole model, cast to fp32 as read; a missing or unexpected key is a
UsageError naming the key and the file; ddp/ZeRO-1/2 load a bf16 folder in the training dtype; the planner's
build bytes. On 2 real ranks each: the bf16 folder trains fp32 on a 2-stage pipeline (first-step loss equals the
HF model's loss on the same batch; saved layer states fp32; manifest dtypes; each rank's reported build memory and
the planner's count of the tensors it owns, exactly), fp32 on ZeRO-3 (partitioned at construction and filled module
by module: the same loss check, fp32 partitions of exactly the planner's share) and bf16 on tp (16-bit weights +
DeepSpeed's fp32 master). The three runs share one launch.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from harness.errors import UsageError

SEED, SEQ_LEN, LR = 1234, 64, 1e-3


def bf16_folder(path, shard: str = "100KB") -> str:
    """tiny-llama's seeded weights in bf16, written as several safetensors files + model.safetensors.index.json."""
    from harness.model.hf import build_model, load_tokenizer

    build_model("tiny-llama", seed=SEED).to(torch.bfloat16).save_pretrained(path, max_shard_size=shard)
    load_tokenizer("tiny-llama").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return bf16_folder(tmp_path_factory.mktemp("load") / "bf16")


def test_folder_has_several_files_and_an_index(folder):
    from pathlib import Path

    index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3


@pytest.mark.parametrize("rank", [0, 1])
def test_tp_rank_reads_its_slices_cast_to_fp32(folder, rank):
    from transformers import AutoModelForCausalLM

    from harness.model.load import meta
    from harness.model.load.materialise import hf_paths, materialise
    from harness.model.load.source import CheckpointFiles, check_keys
    from harness.model.parallel.tensor import shard_model

    whole = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).float()
    shard_model(whole, None, rank, 2)  # the reference: split after a whole load
    model = meta.build_on_meta(whole.config)
    source = CheckpointFiles(folder)
    check_keys(source, model)
    assert source.dtype() == "bfloat16"
    shard_model(model, None, rank, 2)  # on meta
    nbytes = materialise(model, hf_paths(model), source, torch.float32, rank, 2)
    assert meta.left_on_meta(model) == []
    want = dict(whole.named_parameters())
    got = dict(model.named_parameters())
    assert sorted(got) == sorted(want)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32, name
        assert torch.equal(tensor, want[name]), name
    assert nbytes == 4 * sum(p.numel() for p in model.parameters())
    from harness.planner.load import owned_params
    from harness.planner.params import count_params

    assert owned_params(count_params(model.config.to_dict()), tp=2) == sum(p.numel() for p in model.parameters())
    for name, buf in model.named_buffers():  # rotary inv_freq: computed at construction, not left on meta
        torch.testing.assert_close(buf, dict(whole.named_buffers())[name])


def test_preset_by_share_equals_the_seeded_model_and_keeps_its_tie():
    """A preset's meta build keeps the LM head tied to the embedding, and materialises to the seeded weights a
    one-process run starts from (one tensor for both names)."""
    from harness.model.load import meta
    from harness.model.load.materialise import hf_paths, materialise
    from harness.model.load.base import open_source
    from harness.model.load.source import check_keys
    from harness.model.hf import build_model, load_model_config

    model = meta.build_on_meta(load_model_config("tiny-gpt2"))
    assert model.lm_head.weight is model.transformer.wte.weight
    source = open_source("tiny-gpt2", SEED)
    check_keys(source, model)
    materialise(model, hf_paths(model), source, torch.float32)
    assert model.lm_head.weight is model.transformer.wte.weight and meta.left_on_meta(model) == []
    want = build_model("tiny-gpt2", seed=SEED).state_dict()
    got = model.state_dict()
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_tied_folder_shard_reads_the_stored_name(tmp_path):
    """A tied folder stores only the embedding (no lm_head.weight); the TP shard reads it once for both names."""
    from transformers import AutoModelForCausalLM

    from harness.model.load import meta
    from harness.model.load.materialise import hf_paths, materialise
    from harness.model.load.source import CheckpointFiles, check_keys
    from harness.model.hf import load_model_config
    from harness.model.parallel.tensor import shard_model

    config = load_model_config("tiny-llama")
    config.tie_word_embeddings = True
    torch.manual_seed(SEED)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    source = CheckpointFiles(tmp_path)
    assert "lm_head.weight" not in source.keys()
    model = meta.build_on_meta(load_model_config(str(tmp_path)))
    check_keys(source, model)
    shard_model(model, None, 1, 2)
    materialise(model, hf_paths(model), source, torch.float32, 1, 2)
    whole = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, whole.model.embed_tokens.weight)


def test_missing_and_unexpected_keys_name_the_key_and_the_file(tmp_path):
    from safetensors.torch import load_file, save_file

    from harness.model.load import meta
    from harness.model.load.source import CheckpointFiles, check_keys
    from harness.model.hf import load_model_config

    path = bf16_folder(tmp_path / "one", shard="10GB")
    weights = load_file(f"{path}/model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    weights["model.layers.9.extra.weight"] = torch.zeros(2)
    save_file(weights, f"{path}/model.safetensors", metadata={"format": "pt"})
    model = meta.build_on_meta(load_model_config(path))
    with pytest.raises(UsageError) as err:
        check_keys(CheckpointFiles(path), model)
    text = str(err.value)
    assert "missing key 'model.layers.1.mlp.down_proj.weight'" in text
    assert f"unexpected key 'model.layers.9.extra.weight' in {path}/model.safetensors" in text
    assert "fix:" in text


def test_whole_load_trains_in_the_recipe_dtype(folder):
    """ddp / ZeRO-1/2 on a bf16 folder: fp32 runs get fp32 weights, bf16 runs keep 16-bit ones (the engine adds
    its fp32 master)."""
    from harness.model.build import build_whole

    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        spec = SimpleNamespace(recipe={"precision": precision, "activation_checkpointing": False,
                                       "train": {"model": folder, "seed": SEED}}, zero_stage=0, ds_config={})
        built = build_whole(spec)
        assert {p.dtype for p in built.module.parameters()} == {dtype}
        assert (built.info.checkpoint_dtype, built.info.train_dtype) == ("bfloat16", str(dtype)[6:])


def test_planner_build_bytes():
    from harness.planner.load import build_bytes

    terms = build_bytes(owned_params=1000, train_dtype="float32", checkpoint_dtype="bfloat16",
                        largest_tensor_params=300)
    assert terms == {"owned": 4000, "convert": 600, "gathered": 0, "source": 0, "total": 4600}
    same = build_bytes(owned_params=1000, train_dtype="bfloat16", checkpoint_dtype="bfloat16",
                       largest_tensor_params=300, gathered_params=50, source_params=10)
    assert same == {"owned": 2000, "convert": 0, "gathered": 100, "source": 40, "total": 2140}
    # ZeRO-3 filled from a folder: the gathered module twice, the read not beside the second copy
    fill = build_bytes(owned_params=1000, train_dtype="float32", checkpoint_dtype="bfloat16",
                       largest_tensor_params=300, gathered_params=50, zero3_fill=True)
    assert fill == {"owned": 4000, "convert": 0, "gathered": 400, "source": 0, "total": 4400}


def _args(folder: str, recipe: str, precision: str, run, micro: int, accum: int) -> list[str]:
    return ["--recipe", recipe, "--model", folder, "--output-dir", str(run), "--set", f"precision={precision}",
            "--set", "train.steps=2", "--set", "train.save_every=2", "--set", "train.eval_every=0",
            "--set", f"train.seq_len={SEQ_LEN}", "--set", "scheduler.type=none", "--set", f"optimizer.lr={LR}",
            "--set", f"batch.micro_batch_per_gpu={micro}", "--set", f"batch.grad_accum_steps={accum}",
            "--set", "batch.train_batch_size=\"auto\"", "--set", "train.eval_fraction=0.02"]


RUNS = {"pipe": ("pipeline", "fp32", 4, 2), "tp": ("tp", "bf16", 4, 1), "zero3": ("zero3", "fp32", 2, 2)}


@pytest.fixture(scope="module")
def launched(folder, tmp_path_factory):
    """The three 2-rank runs of the bf16 folder (RUNS: recipe, precision, micro, accum) in ONE launch
    (tests/drivers/jobs.py); each run's folder by name under the root, and each run's stdout."""
    from helpers.launch import job_output, launch_jobs

    root = tmp_path_factory.mktemp("runs")
    cases = [_args(folder, recipe, precision, root / name, micro=micro, accum=accum)
             for name, (recipe, precision, micro, accum) in RUNS.items()]
    proc = launch_jobs(cases, root)
    return root, {name: job_output(proc.stdout, i) for i, name in enumerate(RUNS)}


def _hf_first_loss(folder: str, global_batch: int, micro_batches: int) -> float:
    """The HF model's loss (fp32, from the folder) on the run's first global batch: one forward, no step."""
    from helpers.baseline import plain_pytorch_losses

    return plain_pytorch_losses(model=folder, steps=1, seq_len=SEQ_LEN, global_batch=global_batch, lr=LR,
                                betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, clip=1.0, seed=SEED,
                                eval_fraction=0.02, micro_batches=micro_batches)[0]


def _check_startup(summary: dict, owned_per_rank: list[int], train_bytes: int) -> None:
    """Each rank reported both phases; the planner's owned tensors are exactly the rank's; the high-water marks
    are consistent (private peak within the phase >= its end, resident peak >= private peak)."""
    startup = summary["startup"]
    assert [p["owned_params"] for p in startup["predicted_per_rank"]] == owned_per_rank
    for rank, records in enumerate(startup["per_rank"]):
        for phase in ("build", "engine_setup"):
            r = records[phase]
            assert r["seconds"] > 0 and r["hwm_reset"] is True, (rank, phase, r)
            assert r["peak_rss_anon_bytes"] >= r["rss_anon_after_bytes"], (rank, phase, r)
            assert r["peak_rss_bytes"] >= r["peak_rss_anon_bytes"], (rank, phase, r)
            assert 0 < r["in_use_after_bytes"] <= r["rss_anon_after_bytes"], (rank, phase, r)  # less malloc's free
        assert startup["predicted_per_rank"][rank]["build_terms"]["owned"] == owned_per_rank[rank] * train_bytes


def _check_fp32_from_bf16_folder(folder: str, run, stdout: str):
    """A run of 2 steps of 8 sequences trained fp32 on the bf16 folder: its dtypes announced and in the manifest,
    its first-step loss the HF model's on the same batch (fp32, 1e-5). Returns the saved step's folder."""
    from helpers.launch import losses

    assert "fp32 (float32 weights, checkpoint bfloat16)" in stdout
    first = losses(run)[1]
    want = _hf_first_loss(folder, global_batch=8, micro_batches=2)
    assert abs(first - want) <= 1e-5 * want, (first, want)
    step = run / "checkpoints" / "global_step2"
    manifest = json.loads((step / "manifest.json").read_text())
    assert (manifest["checkpoint_dtype"], manifest["train_dtype"]) == ("bfloat16", "float32")
    return step


@pytest.mark.multirank
def test_pipeline_trains_a_bf16_folder_in_fp32_from_its_own_weights(folder, launched):
    run, stdout = launched[0] / "pipe", launched[1]["pipe"]
    step = _check_fp32_from_bf16_folder(folder, run, stdout)
    manifest = json.loads((step / "manifest.json").read_text())
    owned = [0, 0]
    for layer in manifest["partition"]["layers"]:
        states = torch.load(step / f"layer_{layer['index']:02d}-model_states.pt", weights_only=True)
        assert {t.dtype for t in states.values()} == {torch.float32}, layer
        owned[layer["stage"]] += sum(t.numel() for t in states.values())
    _check_startup(json.loads((run / "summary.json").read_text()), owned, 4)
    assert "[memory]  rank 1: build" in stdout


@pytest.mark.multirank
def test_tp_trains_a_bf16_folder_in_bf16_with_an_fp32_master(folder, launched):
    from helpers.launch import losses

    run = launched[0] / "tp"
    first = losses(run)[1]
    want = _hf_first_loss(folder, global_batch=4, micro_batches=1)
    assert abs(first - want) <= 2e-2 * want, (first, want)  # bf16 weights and activations vs fp32
    step = run / "checkpoints" / "global_step2"
    manifest = json.loads((step / "manifest.json").read_text())
    assert (manifest["checkpoint_dtype"], manifest["train_dtype"]) == ("bfloat16", "bfloat16")
    owned = []
    for tp_rank in (0, 1):
        module = torch.load(step / f"mp_rank_{tp_rank:02d}_model_states.pt", weights_only=False)["module"]
        assert {t.dtype for t in module.values()} == {torch.bfloat16}
        owned.append(sum(t.numel() for t in module.values()))
        optim_file, = step.glob(f"bf16_zero_pp_rank_0_mp_rank_{tp_rank:02d}_optim_states.pt")
        optim = torch.load(optim_file, weights_only=False)["optimizer_state_dict"]
        master = optim["single_partition_of_fp32_groups"]
        assert {t.dtype for t in master} == {torch.float32}
        assert sum(t.numel() for t in master) - sum(optim["group_paddings"]) == owned[-1]
    _check_startup(json.loads((run / "summary.json").read_text()), owned, 2)


@pytest.mark.multirank
def test_zero3_trains_a_bf16_folder_in_fp32_partitioned_at_load(folder, launched):
    """ZeRO-3 of a folder is partitioned at construction and filled module by module (load/zero3.py): the
    first-step loss is the HF model's, the saved partitions are fp32 and hold exactly the planner's share, and
    each rank's build terms are the planner's (its share + twice the largest module)."""
    run, stdout = launched[0] / "zero3", launched[1]["zero3"]
    step = _check_fp32_from_bf16_folder(folder, run, stdout)
    owned = []
    for rank in (0, 1):
        optim = torch.load(step / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", weights_only=False)
        flat = optim["optimizer_state_dict"]["fp32_flat_groups"]
        assert {t.dtype for t in flat} == {torch.float32}
        owned.append(sum(t.numel() for t in flat))
    summary = json.loads((run / "summary.json").read_text())
    _check_startup(summary, owned, 4)
    largest_module = 512 * 64  # tiny-llama's embedding (and head): vocab x hidden, the largest module gathered
    for rank, records in enumerate(summary["startup"]["per_rank"]):
        build, pred = records["build"], summary["startup"]["predicted_per_rank"][rank]
        assert pred["build_terms"] == {"owned": owned[rank] * 4, "convert": 0, "gathered": 2 * largest_module * 4,
                                       "source": 0, "total": owned[rank] * 4 + 8 * largest_module}, pred
        growth = build["peak_rss_anon_bytes"] - build["rss_anon_before_bytes"]
        # + the build's own code and allocator (~34 MiB measured whatever the model: tiny here); the real-size
        # bound (share + 2 x the embedding, 0.2B Llama) is measured by bench/scale.py --recipes zero3
        assert growth <= pred["build_bytes"] + (48 << 20), (rank, growth, pred)
