"""rl.async_generator_device (issue 46 item 7): where each trainer rank's generator process holds its copy of the
policy and its KV cache, and what harness plan --async counts for it.
- the placement decision (harness/rl/async_rollouts.generator_device): auto follows the trainer rank's engine (its
  own CUDA device, else CPU), cpu is always CPU, cuda on a trainer not on CUDA is an error;
- the process builds its copy on the device it is given (harness/rl/generation/worker.build; the meta device stands
  in for a GPU here) and loads the pipe's CPU tensors into it;
- cuda without CUDA is refused before any rank trains: one process through harness/run.py, exit 2, nothing written;
- the planner's term: on the plan's GPUs (auto, cuda) the copy and its KV cache are per-GPU bytes fitted into what
  the layout leaves free beside training; cpu counts them in host memory; --recipe auto's fit (fit_rollouts) skips a
  layout whose free memory cannot hold them.
The GPU itself (the copy on the trainer's device, its peak CUDA memory against the planner) is bench/gpu_check.sh's
grpo_async case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from harness.cli import main
from harness.planner import rl
from harness.planner.params import count_params, model_shape
from harness.rl.async_rollouts import async_device_problem, generator_device

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "tie_word_embeddings": False}


@pytest.mark.parametrize("choice,trainer,expected", [
    ("auto", "cpu", "cpu"), ("cpu", "cpu", "cpu"), ("auto", "cuda:1", "cuda:1"), ("cpu", "cuda:1", "cpu"),
    ("cuda", "cuda:3", "cuda:3"), ("auto", torch.device("cuda", 0), "cuda:0"),
])
def test_the_generator_sits_on_the_trainer_ranks_own_device_unless_told_cpu(choice, trainer, expected):
    assert generator_device(choice, trainer) == expected


def test_cuda_on_a_trainer_not_on_cuda_is_an_error_and_refused_before_launch():
    with pytest.raises(ValueError, match="runs on cpu, not CUDA"):
        generator_device("cuda", "cpu")
    rl_keys = {"async": True, "async_generator_device": "cuda"}
    assert "do not train on CUDA" in async_device_problem(rl_keys, cuda=False)
    assert async_device_problem(rl_keys, cuda=True) is None
    assert async_device_problem({**rl_keys, "async_generator_device": "auto"}, cuda=False) is None
    assert async_device_problem({**rl_keys, "async": False}, cuda=False) is None


def test_the_process_builds_its_copy_on_the_device_it_is_given():
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.rl.generation.worker import build

    meta = build(LlamaForCausalLM, LlamaConfig(**TINY), torch.float32, "meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    model = build(LlamaForCausalLM, LlamaConfig(**TINY), torch.float32, "cpu")
    source = dict(LlamaForCausalLM(LlamaConfig(**TINY)).named_parameters())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, tensor in source.items():
            params[name].data.copy_(tensor.detach().to("cpu", copy=True))  # as serve() loads a bucket
    assert all(torch.equal(params[n], t) for n, t in source.items())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_cuda_generator_without_cuda_is_refused_before_any_rank_trains(tmp_path):
    from helpers.launch import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    env.update(WORLD_SIZE="1", PYTHONPATH=str(ROOT))
    argv = ["--recipe", "zero2", "--output-dir", str(tmp_path / "run"), "--set", "train.objective=grpo",
            "--set", "rl.num_generations=4", "--set", "batch.micro_batch_per_gpu=4", "--set", "rl.async=true",
            "--set", "rl.async_generator_device=cuda"]
    proc = subprocess.run([sys.executable, "harness/run.py", *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "rl.async_generator_device: rl.async_generator_device cuda" in proc.stderr
    assert "fix: run on a GPU node, or set rl.async_generator_device=auto" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def _plan(capsys, *extra, gpu_mem="80GB") -> dict:
    main(["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", gpu_mem, "--objective", "grpo", "--zero", "3",
          "--micro-batch", "16", "--async", "--json", *extra])
    return json.loads(capsys.readouterr().out)["rollouts"]


def test_on_gpus_the_generator_copy_and_kv_are_per_gpu_bytes_in_the_fit(capsys):
    plan = _plan(capsys)
    a = plan["async"]
    held = a["weights_bytes"] + plan["kv_cache_bytes"]
    assert a["device"] == "cuda" and a["gpu_bytes_per_rank"] == held and a["host_bytes_per_rank"] == 0
    assert a["free_bytes"] == plan["free_bytes"] and a["fits"] == (held <= plan["free_bytes"]) is True
    cpu = _plan(capsys, "--async-generator-device", "cpu")["async"]
    assert cpu["device"] == "cpu" and cpu["host_bytes_per_rank"] == held and cpu["gpu_bytes_per_rank"] == 0
    assert cpu["fits"] and cpu["async_step_s"] == a["async_step_s"]
    small = _plan(capsys, gpu_mem="24GB")  # ZeRO-3 training fits, a whole 15 GB bf16 copy beside it does not
    assert small["async"]["gpu_bytes_per_rank"] > small["free_bytes"] and small["async"]["fits"] is False
    main(["plan", "--model", "qwen2.5-7b", "--gpus", "8", "--gpu-mem", "24GB", "--objective", "grpo", "--zero", "3",
          "--micro-batch", "16", "--async"])
    out = capsys.readouterr().out
    assert "on the trainer rank's GPU each" in out and "does not fit; set rl.async_generator_device=cpu" in out


def test_recipe_auto_skips_a_layout_without_room_for_the_gpu_generator():
    """fit_rollouts: the layout fits training and the hf generation's extra, not a whole copy + KV cache."""
    count, shape = count_params(TINY), model_shape(TINY)
    work = rl.RolloutWork(sequences=4, prompt_len=16, completion_len=16)
    copy = 2 * count.total + rl.kv_cache_bytes(shape, sequences=4, tokens=32, lp=2)
    gpu_mem = 10 * copy
    layout = {"fits": True, "zero_stage": 0, "dp": 1, "label": "zero0",
              "memory": {"gpu_bytes": int(gpu_mem * 0.9) - copy + 1}}  # one byte short of the copy
    args = {"gpu_mem_bytes": gpu_mem, "lp": 2, "threshold": 0, "reserve": 0.1, "profile": {}}
    assert rl.fit_rollouts([layout], count, shape, work, **args)[0] is layout
    assert rl.fit_rollouts([layout], count, shape, work, **args, async_on_gpu=True) == (None, None)
    roomy = {**layout, "memory": {"gpu_bytes": int(gpu_mem * 0.9) - copy}}
    assert rl.fit_rollouts([roomy], count, shape, work, **args, async_on_gpu=True)[0] is roomy
    assert rl.async_device("auto", "cpu") == "cpu" and rl.async_device("auto", "cuda") == "cuda"
    assert rl.async_device("cpu", "cuda") == "cpu"
