"""planner/rl.py: the generation's KV cache, gathered weights (whole or layer groups), decode and prefill, the vLLM
weight sync, and `harness plan --objective grpo`. The live generator's peak equals gather_plan's on real ranks
(tests/test_rl_generation.py)."""

from __future__ import annotations

import json

import pytest

from harness.cli import main
from harness.planner import rl
from harness.planner.params import count_params, model_shape

QWEN_7B = {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
           "max_position_embeddings": 32768}


def test_kv_cache_is_two_x_layers_x_kv_heads_x_head_dim_x_tokens_x_sequences_x_bytes():
    shape = model_shape(QWEN_7B)
    assert rl.kv_cache_bytes(shape, sequences=8, tokens=1536, lp=2) == 2 * 28 * 4 * 128 * 1536 * 8 * 2


def test_gather_groups_fit_the_bound_and_whole_when_it_fits():
    count = count_params(QWEN_7B)
    persistent, outside, layer = rl.zero3_pieces(count, lp=2, threshold=100_000, hidden=3584)
    whole = rl.gather_plan(count, lp=2, threshold=100_000, hidden=3584, bound_bytes=None)
    assert whole.whole and whole.peak_bytes == persistent + outside + 28 * layer and whole.per_token_gather_bytes == 0
    bound = outside + 5 * layer + 1
    groups = rl.gather_plan(count, lp=2, threshold=100_000, hidden=3584, bound_bytes=bound)
    assert (groups.layers_per_group, groups.num_groups) == (5, 6)  # ceil(28 / 5)
    assert groups.peak_bytes - groups.persistent_bytes <= bound and groups.per_token_gather_bytes == 28 * layer
    assert rl.gather_plan(count, lp=2, threshold=100_000, hidden=3584, bound_bytes=1).layers_per_group == 1
    assert rl.gather_plan(count, lp=2, threshold=0, hidden=3584, bound_bytes=None, stage=2).per_token_gather_bytes == 0


def test_choose_gather_whole_or_groups_from_free_memory():
    assert rl.choose_gather(model_bytes=10, layer_bytes=2, free_bytes=100).whole
    choice = rl.choose_gather(model_bytes=100, layer_bytes=20, free_bytes=100, kv_bytes=10)
    assert not choice.whole and choice.bound_bytes == 40 and "layer groups within" in choice.reason
    assert rl.choose_gather(model_bytes=100, layer_bytes=20, free_bytes=10).bound_bytes == 20  # one layer at least


def test_decode_is_one_pass_over_the_weights_per_token_and_groups_add_the_gather():
    base = rl.decode_s(weight_bytes=10**9, kv_bytes=0, completion_tokens=100, hbm_gbps=1000)
    assert base == pytest.approx(0.1)
    assert rl.decode_s(weight_bytes=10**9, kv_bytes=0, completion_tokens=200, hbm_gbps=1000) == pytest.approx(2 * base)
    grouped = rl.decode_s(weight_bytes=10**9, kv_bytes=0, completion_tokens=100, hbm_gbps=1000,
                          gather_bytes_per_token=10**9, link_gbps=100, world=8)
    assert grouped == pytest.approx(base + 100 * 10**9 * 7 / 8 / 100e9)


def test_sync_buckets_count_gathered_bytes():
    sync = rl.sync_plan(total_params=10**9, lp=2, bucket_mb=256, world=8, link_gbps=100, hbm_gbps=1000)
    assert sync["bytes"] == 2 * 10**9 and sync["buckets"] == -(-2 * 10**9 // (256 << 20))
    assert sync["peak_bytes"] == 256 << 20


def test_plan_objective_grpo_prints_and_returns_the_rollouts(capsys):
    code = main(["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "80GB", "--objective", "grpo",
                 "--zero", "3", "--micro-batch", "16", "--max-completion-length", "1024", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)["rollouts"]
    assert out["kv_cache_bytes"] == 2 * 28 * 4 * 128 * (512 + 1024) * 16 * 2
    assert not out["gather"]["whole"] and out["gather"]["layers_per_group"] >= 1
    # vLLM's model and KV cache (15.9 GB) do not fit the 12.9 GB free beside training: hf in layer groups
    assert out["vllm"]["sync"]["buckets"] >= 2 and out["recommend"].startswith("hf, layer groups of ")
    main(["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "80GB", "--objective", "grpo", "--zero", "3"])
    text = capsys.readouterr().out
    assert "Rollouts on " in text and "KV cache" in text and "recommend" in text
    assert out["turns"] == 1 and out["prefill_tokens"] == 512


def test_multi_turn_rollouts_prefill_the_prompt_and_the_turns_so_far_once_per_turn(capsys):
    """rl.max_tool_calling_iterations 3: 4 generate calls; the KV cache is the single turn's (max_completion_length
    counts the tool tokens), the prefill 4 x prompt + 3/2 x completion tokens per sequence."""
    args = ["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "80GB", "--objective", "grpo", "--zero", "3",
            "--micro-batch", "8", "--max-completion-length", "1024", "--json"]
    main(args)
    one = json.loads(capsys.readouterr().out)["rollouts"]
    main(args + ["--max-tool-calling-iterations", "3"])
    four = json.loads(capsys.readouterr().out)["rollouts"]
    assert four["turns"] == 4 and four["prefill_tokens"] == 4 * 512 + 3 * 1024 // 2
    assert four["kv_cache_bytes"] == one["kv_cache_bytes"]
    assert four["hf"]["prefill_s"] == pytest.approx(one["hf"]["prefill_s"] * (4 * 512 + 1536) / 512)
    assert four["tool_tokens"] == 0 and four["sampled_tokens"] == 1024  # no tool-result budget given: all sampled


def test_multi_turn_tool_results_count_in_the_budget_and_are_prefilled_not_decoded(capsys):
    """--tool-result-tokens 200 with 3 rounds: 600 of the 1,024 completion tokens are tool tokens, 424 are decoded
    (vLLM's decode scales with them); a budget the rounds would overflow leaves one sampled token per turn."""
    args = ["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "80GB", "--objective", "grpo", "--zero", "3",
            "--micro-batch", "8", "--max-completion-length", "1024", "--max-tool-calling-iterations", "3", "--json"]
    main(args)
    bare = json.loads(capsys.readouterr().out)["rollouts"]
    main(args + ["--tool-result-tokens", "200"])
    tools = json.loads(capsys.readouterr().out)["rollouts"]
    assert (tools["tool_tokens"], tools["sampled_tokens"]) == (600, 424)
    assert tools["kv_cache_bytes"] == bare["kv_cache_bytes"] and tools["prefill_tokens"] == bare["prefill_tokens"]
    assert tools["vllm"]["decode_s"] == pytest.approx(bare["vllm"]["decode_s"] * 424 / 1024)
    assert tools["hf"]["decode_s"] < bare["hf"]["decode_s"]
    main(args + ["--tool-result-tokens", "1000"])
    over = json.loads(capsys.readouterr().out)["rollouts"]
    assert (over["tool_tokens"], over["sampled_tokens"]) == (1020, 4)
    main(args[:-1] + ["--tool-result-tokens", "200"])
    assert "decode" in (text := capsys.readouterr().out) and "424 sampled tokens, 600 tool tokens prefilled" in text


def test_a_whole_zero3_gather_is_paid_once_per_generate_call():
    count, shape = count_params(QWEN_7B), model_shape(QWEN_7B)
    profile = {"hbm_gbps": 1000, "intra_node_gbps": 100}
    plans = [rl.rollout_plan(count, shape, rl.RolloutWork(sequences=8, prompt_len=512, completion_len=1024,
                                                          turns=turns), stage=3, world=8, lp=2, threshold=100_000,
                             free_bytes=80 << 30, gpu_mem_bytes=80 << 30, profile=profile) for turns in (1, 4)]
    assert all(p["gather"]["whole"] for p in plans)
    gather_s = 2 * count.total * 7 / 8 / 100e9
    assert plans[1]["hf"]["decode_s"] - plans[0]["hf"]["decode_s"] == pytest.approx(3 * gather_s)


def test_vllm_is_refused_before_launch_without_cuda():
    import torch

    from harness.rl.generation import generator_problems

    recipe = {"train": {"objective": "grpo"}, "rl": {"generator": "vllm"}}
    problems = generator_problems(recipe)
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert [p.path for p in problems] == ["rl.generator"]
    assert "needs CUDA GPUs; this machine has none" in problems[0].message and "rl.generator=hf" in problems[0].fix
    assert generator_problems({"train": {"objective": "grpo"}, "rl": {"generator": "hf"}}) == []


def test_vllm_sync_buckets_count_gathered_bytes_not_numel():
    """A ZeRO-3 parameter's numel() is 0; buckets must count ds_numel (what TRL's bucketing missed)."""
    import torch

    from harness.rl.generation.vllm import buckets

    class Partitioned(torch.nn.Parameter):
        pass

    params = []
    for _ in range(6):
        p = Partitioned(torch.empty(0))
        p.ds_numel = 1 << 18  # 1 MiB in fp32 when gathered
        params.append(p)
    got = buckets([(f"w{i}", p, None) for i, p in enumerate(params)], bucket_bytes=2 << 20)
    assert [len(b) for b in got] == [2, 2, 2]


def auto(sets: list[str], gpu_mem: int):
    from harness.config.recipes import complete
    from harness.planner import hardware
    from harness.train import auto_recipe

    settings = complete({"description": "auto"}, "--recipe auto", ["train.objective=grpo", "train.model=qwen2.5-7b",
                                                                   "train.seq_len=2048", *sets])
    hw = {"gpus_per_node": 8, "nodes": 1, "gpu_mem_bytes": gpu_mem, "cpu_mem_bytes": 10**12, "nvme_bytes": None,
          "device": "cuda", "device_name": "H100"}
    profile = hardware.load("h100-80gb-sxm")
    result = auto_recipe.plan_for(settings, hw, profile)
    return result, *auto_recipe.rl_layout(settings, hw, profile, result)


def test_recipe_auto_plans_rl_runs_with_their_generation():
    result, layout, line = auto(["rl.max_completion_length=1024", "batch.micro_batch_per_gpu=8"], 80 * 10**9)
    assert layout["label"] == result.recommended["label"] and layout["rl_overrides"] == [] and "KV cache" in line
    # 2 x 8.7K-token completions per rank: ZeRO-3 holds the training; the whole model beside the KV cache does not
    # fit what is left, so the generation gathers layer groups within rl.gather_mb
    result, layout, line = auto(["rl.max_completion_length=8192", "batch.micro_batch_per_gpu=2"], 80 * 10**9)
    assert layout["zero_stage"] == 3 and "layer groups" in line
    assert layout["rl_overrides"] and layout["rl_overrides"][0].startswith("rl.gather_mb=")
    # 4 of them per rank: training fits (ZeRO-3 with offload), the generation beside it nowhere
    result, layout, _ = auto(["rl.max_completion_length=8192", "batch.micro_batch_per_gpu=4"], 80 * 10**9)
    assert result.recommended is not None and layout is None and "no layout leaves room for the generation" in result.missing[-1]


def test_recipe_auto_plans_the_rl_workload_not_train_seq_len():
    """`--recipe auto` for grpo gives the planner the RL rows: completions of rl.max_prompt_length +
    rl.max_completion_length tokens (train.seq_len plays no part), one row per item, a reference engine only when
    rl.beta > 0, and no layout the run refuses (tp, pp, sp)."""
    lengths = ["rl.max_prompt_length=256", "rl.max_completion_length=768", "batch.micro_batch_per_gpu=4"]
    result, _, _ = auto(lengths, 80 * 10**9)
    work, best = result.workload, result.recommended
    assert (work.objective, work.seq_len, work.rows_per_item, work.beta) == ("grpo", 1024, 1, 0.0)
    assert best["memory"]["activations"]["tokens_per_rank"] == best["micro_batch"] * 1024
    assert best["memory"]["reference"]["mode"] is None and "beta 0" in best["memory"]["reference"]["why"]
    assert all(r["tp"] == r["pp"] == r["sp"] == 1 for r in result.candidates if r["fits"])
    assert best["overrides"]["rl.max_completion_length"] == 768 and "train.seq_len" not in best["overrides"]
    # the row does not change with train.seq_len; beta > 0 loads a reference engine (no LoRA), in the totals
    with_ref, _, _ = auto([*lengths, "train.seq_len=8192", "rl.beta=0.04"], 80 * 10**9)
    ref = with_ref.recommended["memory"]["reference"]
    assert with_ref.workload.seq_len == 1024 and ref["mode"] == "engine"
    assert ref["modes"]["precomputed"]["applicable"] is False
    same = next(r for r in result.candidates if r["label"] == with_ref.recommended["label"])
    assert with_ref.recommended["memory"]["gpu_bytes"] - same["memory"]["gpu_bytes"] == ref["modes"]["engine"]["gpu"]


def test_the_grpo_headline_states_completions_and_prompt_plus_completion(capsys):
    """The headline of `harness plan --objective grpo` counts completions of prompt + completion tokens (not pairs of
    2,048-token rows), and with TRL's beta 0 shows no reference; --json carries the same workload."""
    args = ["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "80GB", "--objective", "grpo",
            "--max-prompt-length", "256", "--max-completion-length", "768"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert ("objective grpo: the micro batch counts completions, 1 per micro-step, each 256 prompt + 768 completion "
            "= 1,024 tokens; generated in the loop; no reference (beta 0: TRL loads none)") in text
    assert "pairs" not in text and "chosen and rejected" not in text and "precomputed" not in text
    assert "micro batch 1 x 1024 tokens" in text and "global batch 8 completions x 1024 = 8,192 tokens" in text
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    work, best = plan["workload"], plan["recommended"]
    assert (work["objective"], work["seq_len"], work["prompt_len"], work["completion_len"]) == ("grpo", 1024, 256, 768)
    assert best["memory"]["activations"]["tokens_per_rank"] == 1024 and best["memory"]["reference"]["mode"] is None
    assert main([*args, "--beta", "0.04", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["recommended"]["memory"]["reference"]["mode"] == "engine"


@pytest.mark.parametrize("extra, message", [
    (["--reference-mode", "precomputed", "--beta", "0.04"], "the completions are generated during training"),
    (["--reference-mode", "engine"], "no reference is loaded when beta is 0"),
    (["--seq-len", "4096"], "give --max-prompt-length and --max-completion-length instead"),
    (["--pairs", "100"], "its batch items are completions, not pairs"),
    (["--teacher", "qwen2.5-7b"], "plan a distillation run: add --objective gkd"),
])
def test_plan_grpo_refuses_what_an_rl_run_refuses(capsys, extra, message):
    code = main(["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "80GB", "--objective", "grpo", *extra])
    assert code == 2 and message in capsys.readouterr().err


def test_async_prices_the_generator_copy_and_overlaps_generate_with_train(capsys):
    """--async: each rank's generator process holds a copy of the weights and the KV cache; the step is
    max(generate, train) + sync against generate + train + sync (max_staleness 0 overlaps nothing). The copy's
    bytes are the live generator process's model's (harness/rl/generation/worker.build)."""
    args = ["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "80GB", "--objective", "grpo", "--zero", "3",
            "--micro-batch", "16", "--json"]
    main(args)
    assert "async" not in json.loads(capsys.readouterr().out)["rollouts"]
    main(args + ["--async"])
    out = json.loads(capsys.readouterr().out)
    plan, a = out["rollouts"], out["rollouts"]["async"]
    generate = plan["hf"]["prefill_s"] + plan["hf"]["decode_s"]
    train = (out["recommended"].get("time") or out["evaluated"]["time"])["step_time_s"]
    sync = plan["vllm"]["sync"]["seconds"]
    assert a["weights_bytes"] == 2 * count_params(QWEN_7B).total
    assert a["bytes_per_process"] == a["weights_bytes"] + plan["kv_cache_bytes"]
    assert a["async_step_s"] == pytest.approx(max(generate, train) + sync)
    assert a["sync_step_s"] == pytest.approx(generate + train + sync) and a["gain"] > 1
    main(args + ["--async", "--max-staleness", "0", "--json"])
    assert json.loads(capsys.readouterr().out)["rollouts"]["async"]["gain"] == 1.0
    main(args[:-1] + ["--async"])
    assert "async step" in capsys.readouterr().out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.rl.generation.worker import build

    config = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "tie_word_embeddings": False}
    model = build(LlamaForCausalLM, LlamaConfig(**config), torch.float32)
    assert sum(p.numel() * 4 for p in model.parameters()) == rl.async_plan(
        model_bytes=4 * count_params(config).total, kv_bytes=0, generate_s=1, train_s=1, sync_s=0,
        max_staleness=1)["weights_bytes"]
