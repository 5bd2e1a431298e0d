#!/usr/bin/env bash
# GPU check: a ~1B Llama-shaped model (TinyLlama-1.1B shape, random weights), bf16, ZeRO-2, seq 2048 on one
# GPU, measured through the harness's profiling hooks. Prints tokens/s, TFLOP/s, MFU and the planner's
# predicted peak memory next to the measured one; leaves metrics.jsonl, summary.json and report.md in OUT_DIR.
# On a node with >= 2 GPUs also a pipeline case (2 stages), with >= 4 a 3D case (pipeline 2 x tensor 2):
# per-stage model states, p2p / TP bytes and the bubble vs the planner, reports in OUT_DIR/pipeline, OUT_DIR/3d.
# Also a QLoRA case (one GPU): a 4-bit NF4 base (bitsandbytes, bnb_4bit_quant_storage = bf16 under ZeRO-3) with
# LoRA adapters, recipe lora_zero3, on a ~1B folder model written first (random weights); OUT_DIR/qlora.
# Also a MoE case: a ~0.5B Qwen3-MoE folder through DeepSpeed AutoEP with grouped_mm expert GEMMs (EP 2 on 2
# GPUs, AutoEP of size 1 on one); OUT_DIR/moe.
# Also a DPO case (one GPU): a TinyLlama-shaped bf16 folder and a generated preference jsonl (300 pairs of random
# words as prompt/chosen/rejected strings), train.objective=dpo for 10 steps at seq 1024 twice: the reference as a
# frozen engine (recipe zero2) and as the base with the adapters off (recipe lora_zero2), and precomputed;
# OUT_DIR/dpo/{precomputed,engine,adapter}. Also fp16 (dynamic loss scaling) on ZeRO-2 and ZeRO-3; OUT_DIR/fp16
# with summary.json (loss, peak memory beside the planner's). Also train.streaming on every GPU: a run on the store
# while its writer writes it, then on the finished store: the same losses step for step; OUT_DIR/stream. Also a
# mixture case (train.datasets, NCCL, bf16): per-source loss and rows from the device, the one-row bound checked;
# OUT_DIR/mixture.
# GRPO (one GPU): the built-in toy task with hf generation in the loop, bf16, beta 0.04 (a reference engine),
# ZeRO-2 and ZeRO-3; OUT_DIR/grpo (reward, time split). Also a GRPO case with a colocated vLLM (grpo_vllm,
# bench/gpu_check_rl.py; needs vllm in the image): weight sync in buckets of gathered bytes, its time and memory
# beside planner/rl.py's; OUT_DIR/grpo_vllm; its multi-turn generate (row streams, vLLM's sampled log-probs) too.
# grpo_tools: multi-turn rollouts with a tool and an environment (tests/fixtures/rl_tools/secret_env.py) on ZeRO-3
# over nccl, bf16, 2 GPUs when there are: the turns in lockstep (an all-reduce per turn), tools/call_frequency,
# the finish reasons; OUT_DIR/grpo_tools. grpo_async: rl.async on ZeRO-3 over nccl (the weights gathered on the GPUs,
# sent to each rank's generator process), its copy on the rank's GPU then in host memory (rl.async_generator_device
# auto, cpu): the staleness bound, the ratios, the times, the generator's peak CUDA memory against harness plan
# --async's per-GPU term; OUT_DIR/grpo_async. grpo_async_vllm (2 GPUs, needs vllm in the image; skips with the
# reason otherwise): rl.async with rl.vllm_mode server, `trl vllm-serve` on GPU 1 and ZeRO-3 training on GPU 0, the
# weights streamed over NCCL every 2 steps: staleness bound, ratios to vLLM's log-probs, times; then the run refused
# before launch with the server stopped; OUT_DIR/grpo_async_vllm.
# Also a vision-language case (bench/vlm.py: a ~0.6B Qwen2-VL, ZeRO-3, images on some rows only, the vision
# tower trained and frozen); OUT_DIR/vlm; and vlm_video, an 8-frame video before each image (PyAV not needed: the
# frames are a list of PNGs); OUT_DIR/vlm_video.
# And vlm_packing (bench/vlm_packing.py on the GPU): packed vision-language rows
# against one conversation per row, summed loss equal under flash-attention varlen / flex_attention / sdpa; Gemma 3's
# packed masks (bench/vlm_gemma_packing.py) under sdpa / eager / flex_attention, loss and every gradient.
# ddp_fp32: ZeRO-0 fp32 on one GPU, its global grad norm reported at every step (harness/train/zero0_step.py).
# distill_served (bench/gpu_check_distill.py; needs vllm in the image): a teacher behind `vllm serve` scored through
# harness/distill/served.py against the precomputed store from transformers on the GPU (top-1 agreement, log-prob
# gap, the top-k loss from each), then the server killed: the error and its seconds; OUT_DIR/distill_served.
# distill: train.objective=gkd (dataset completions, lmbda 0) on the built-in set, a ~0.3B bf16 Llama-shaped teacher
# folder (random weights) as a frozen engine, ZeRO-3-sharded under zero3 and a whole copy under zero2, the tiny-llama
# student; loss, teacher entropy, the time split and peak memory; then on-policy on ZeRO-3 with HF generate (and
# seq_kd: the teacher engine generates the other rows) and with a colocated vLLM (distill.use_vllm; skipped without
# vllm): generate time, completions recorded in rollouts.jsonl; OUT_DIR/distill.
# ray_gpu: `harness ray` on a one-node Ray cluster holding 1-2 GPUs (needs ray); OUT_DIR/ray_gpu.
# optimizers: zero2 (AdamW fp32 states), zero2_bf16_states, zero2_bf16_sr (torchao's stochastic-rounding step,
# torch.compile'd on CUDA), zero2_muon (Muon's update torch.compile'd on CUDA) on
# every GPU, 30 steps each: loss, step time, peak memory and model states per rank beside the planner's;
# OUT_DIR/optimizers (docs/optimizers.md).
# fp8: train.fp8 (torchao float8 matmuls; needs compute capability 8.9+ and torchao) against bf16 matmuls on the ~1B
# folder model of the qlora case, ZeRO-2, seq 2048, 30 steps on every GPU: tokens/s, peak memory per rank and the
# loss of each, side by side; OUT_DIR/fp8/{bf16,fp8} (docs/optimizers.md).
# Sized for one H200: ~1-2 minutes of work, capped at 7.5 minutes (timeout), so the whole check fits in 8.
#
# The GPU machine has torch (CUDA) and transformers but no package registry, so DeepSpeed comes from wheels
# prepared beforehand on a machine that can reach one (pure-Python deepspeed wheel: its ops are compiled on
# first use, and this check uses none of them; binary deps for the GPU machine's Python version):
#
#   bench/gpu_check.sh --prepare [PYTHON_VERSION]      e.g. --prepare 3.10   -> bench/wheels/
#   bench/gpu_check.sh [OUT_DIR] [gpu_check.py options]  on the GPU machine    (default OUT_DIR /tmp/gpu_check)
#
# With the device tool of this project: run(command="bash bench/gpu_check.sh $OUT/gpu_check",
# carry=["bench/wheels"], timeout_s=480); the report comes back under $OUT.
# Environment: PYTHON (default python3), GPU_CHECK_WHEELS (default bench/wheels).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$ROOT/bench/wheels}
DEEPSPEED_VERSION=0.19.8
# deepspeed's own requirements that a torch + transformers image may lack (numpy, packaging, tqdm come with those)
DEPS=(hjson py-cpuinfo msgpack einops ninja psutil pydantic)

if [[ "${1:-}" == "--prepare" ]]; then
    target=${2:-$($PY -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')}
    mkdir -p "$WHEELS"
    $PY -m pip wheel --no-deps --wheel-dir "$WHEELS" "deepspeed==$DEEPSPEED_VERSION" "peft==0.21.2" "accelerate==1.15.0"
    $PY -m pip download --only-binary=:all: --python-version "$target" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        --dest "$WHEELS" "${DEPS[@]}" bitsandbytes "torchao==0.18.0"
    echo "[prepare] wheels for Python $target in $WHEELS; copy them to the GPU machine (or carry bench/wheels)"
    exit 0
fi

OUT=${1:-/tmp/gpu_check}
shift || true
mkdir -p "$OUT"

if ! $PY -c "import deepspeed" 2>/dev/null; then
    if ! ls "$WHEELS"/deepspeed-*.whl >/dev/null 2>&1; then
        echo "error: deepspeed is not installed and $WHEELS holds no deepspeed wheel" >&2
        echo "    fix: run 'bench/gpu_check.sh --prepare PYTHON_VERSION' where pip reaches a registry," \
             "then bring bench/wheels along" >&2
        exit 2
    fi
    if $PY -m pip --version >/dev/null 2>&1; then
        bnb=(); ls "$WHEELS"/bitsandbytes-*.whl >/dev/null 2>&1 && bnb=(bitsandbytes)  # the qlora case's only
        ls "$WHEELS"/torchao-*.whl >/dev/null 2>&1 && bnb+=(torchao)  # the fp8 case's only
        $PY -m pip install --quiet --no-index --find-links "$WHEELS" "deepspeed==$DEEPSPEED_VERSION" peft "${bnb[@]}"
    else  # no pip in the image: wheels are zip files, unpack them onto the path
        $PY - "$WHEELS" "$OUT/site" <<'EOF'
import sys, zipfile, pathlib
wheels, site = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for wheel in sorted(wheels.glob("*.whl")):
    zipfile.ZipFile(wheel).extractall(site)
EOF
        export PYTHONPATH="$OUT/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi

$PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'error: torch sees no CUDA device')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
# Cases: zero2 (one GPU), pipeline (2 stages, 2 GPUs), 3d (pipeline 2 x tensor 2, 4 GPUs). Default: every case
# the visible GPUs allow; GPU_CHECK_CASES="pipeline 3d" picks. The pipeline cases run bench/pipe_probe.py (a
# TinyLlama-shaped PipelineModule through the harness's hooks: per-stage model states, p2p / TP bytes, bubble).
CASES=${GPU_CHECK_CASES:-zero2 pipeline 3d qlora long_context moe dpo fp16 stream mixture grpo grpo_vllm grpo_async grpo_async_vllm grpo_tools vlm vlm_video vlm_packing ddp_fp32 distill distill_served ray_gpu optimizers fp8}
need() { case $1 in pipeline) echo 2 ;; 3d) echo 4 ;; *) echo 1 ;; esac; }
# A ~1B Llama-shaped folder model (TinyLlama-1.1B shape, random bf16 weights, the built-in tokenizer): qlora and fp8.
# A random-weight bf16 Llama folder with the shipped tokenizer: write_llama_folder DIR HIDDEN INTERMEDIATE LAYERS HEADS
write_llama_folder() {
    $PY - "$@" <<'EOF'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from harness.model.hf import _shipped_eos_id, load_tokenizer
out, (hidden, inter, layers, heads) = sys.argv[1], map(int, sys.argv[2:6])
eos = _shipped_eos_id()
cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=4, bos_token_id=eos, eos_token_id=eos)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
load_tokenizer("tiny-llama").save_pretrained(out)
EOF
}
write_1b_folder() { write_llama_folder "$1" 2048 5632 22 32; }

start=$(date +%s)
for case in $CASES; do
    if (( gpus < $(need "$case") )); then
        echo "[skip]    $case needs $(need "$case") GPUs, $gpus visible"
        continue
    fi
    case $case in
        qlora|fp8) [[ -d "$OUT/qlora/model" ]] || write_1b_folder "$OUT/qlora/model" ;;
    esac
    case $case in
        distill_served)  # a vLLM-served teacher against the precomputed store; skips itself without vllm
            timeout 400 $PY "$ROOT/bench/gpu_check_distill.py" --out "$OUT/distill_served" \
                || echo "[distill_served] failed (exit $?)" ;;
        grpo_tools)  # multi-turn rollouts with tools on ZeRO-3 over nccl: lockstep turns, bf16 (tests/test_rl_tools.py)
            n=1; (( gpus >= 2 )) && n=2
            $PY -c "import sys; sys.path.insert(0, '$ROOT/tests'); from pathlib import Path
from helpers.tool_models import tool_model_folder, write_prompts
tool_model_folder('$OUT/grpo_tools/model'); write_prompts(Path('$OUT/grpo_tools/prompts.jsonl'), 64)" \
                && timeout 300 $PY -m deepspeed.launcher.runner --num_gpus $n "$ROOT/harness/run.py" --recipe zero3 \
                --set train.objective=grpo --set precision=bf16 --set train.model="$OUT/grpo_tools/model" \
                --set train.dataset="$OUT/grpo_tools/prompts.jsonl" --set train.steps=8 --set train.log_every=1 \
                --set batch.micro_batch_per_gpu=8 --set rl.num_generations=4 --set rl.max_completion_length=96 \
                --set rl.max_prompt_length=1024 --set rl.max_tool_calling_iterations=3 --set optimizer.lr=2e-3 \
                --set scheduler.type=none --set rl.environment_factory="$ROOT/tests/fixtures/rl_tools/secret_env.py:SecretEnv" \
                --output-dir "$OUT/grpo_tools/run" --overwrite || echo "[grpo_tools] failed (exit $?)"
            $PY - "$OUT/grpo_tools/run" <<'EOF' || true
import collections, json, sys
rs = [r for r in map(json.loads, open(sys.argv[1] + "/metrics.jsonl")) if r["kind"] == "train"]
lines = [json.loads(x) for x in open(sys.argv[1] + "/rollouts.jsonl")]
print(f"[grpo_tools] reward {rs[0]['reward']:.3f} -> {rs[-1]['reward']:.3f}, tools/call_frequency "
      f"{rs[0]['tools/call_frequency']:.2f} -> {rs[-1]['tools/call_frequency']:.2f}, finish "
      f"{dict(collections.Counter(r['finish'] for r in lines))}, most turns {max(len(r['turns']) for r in lines)}")
EOF
            ;;
        grpo_vllm)  # GRPO generation with a colocated vLLM on ZeRO-3: weight-sync time, bytes, buckets and memory
            n=1; (( gpus >= 2 )) && n=2  # against planner/rl.py (bench/gpu_check_rl.py); skips itself without vllm
            timeout 400 $PY -m deepspeed.launcher.runner --num_gpus $n "$ROOT/bench/gpu_check_rl.py" \
                --out "$OUT/grpo_vllm" || echo "[grpo_vllm] failed (exit $?)" ;;
        grpo_async)  # rl.async on ZeRO-3 over nccl: each rank's weights gathered in buckets on the GPU, sent to its
            n=1; (( gpus >= 2 )) && n=2  # generator process, whose copy and KV cache sit on the rank's own GPU (auto)
            for where in auto cpu; do  # and then in host memory (cpu): the step times side by side
                timeout 240 $PY -m deepspeed.launcher.runner --num_gpus $n "$ROOT/harness/run.py" --recipe zero3 \
                    --set train.objective=grpo --set precision=bf16 --set train.steps=8 --set train.log_every=1 \
                    --set batch.micro_batch_per_gpu=8 --set rl.num_generations=4 --set rl.max_completion_length=16 \
                    --set optimizer.lr=3e-2 --set scheduler.type=none --set rl.async=true --set rl.max_staleness=2 \
                    --set rl.weight_sync_steps=2 --set rl.async_generator_device=$where \
                    --output-dir "$OUT/grpo_async/$where" --overwrite || echo "[grpo_async $where] failed (exit $?)"
            done
            mem=$($PY -c "import torch; print(torch.cuda.get_device_properties(0).total_memory)")
            $PY -m harness.cli plan --model tiny-llama --gpus $n --gpu-mem "${mem}B" --objective grpo --zero 3 \
                --precision bf16 --micro-batch 8 --max-completion-length 16 --num-generations 4 --async \
                --max-staleness 2 --json > "$OUT/grpo_async/plan.json" || echo "[grpo_async] plan failed (exit $?)"
            $PY - "$OUT/grpo_async" <<'EOF' || true
import json, sys
root = sys.argv[1]
plan = json.load(open(root + "/plan.json"))["rollouts"]["async"]
for where in ("auto", "cpu"):
    rs = [r for r in map(json.loads, open(f"{root}/{where}/metrics.jsonl")) if r["kind"] == "train"]
    lines = [json.loads(x) for x in open(f"{root}/{where}/rollouts.jsonl")]
    worst = max(r["step"] - 1 - r["model_version"] for r in lines)
    print(f"[grpo_async {where}] reward {rs[0]['reward']:.3f} -> {rs[-1]['reward']:.3f}, staleness at most {worst} "
          f"(bound 2), ratio {min(r['sampling/importance_sampling_ratio/min'] for r in rs):.3f}.."
          f"{max(r['sampling/importance_sampling_ratio/max'] for r in rs):.3f}, generate wait "
          f"{sum(r['time/generate_s'] for r in rs[1:]):.2f} s, generator {sum(r['time/generator_s'] for r in rs[1:]):.2f}"
          f" s, train {sum(r['time/train_s'] for r in rs[1:]):.2f} s")
    if where == "auto":  # the plan's term: the copy + the KV cache at rl.max_prompt_length (a bound: prompts are shorter)
        peak = max(r.get("memory/generator_peak_bytes", 0) for r in rs)
        print(f"[grpo_async auto] generator peak CUDA memory {peak / 2**20:.1f} MiB (0: not on the GPU) against the "
              f"planner's {plan['gpu_bytes_per_rank'] / 2**20:.1f} MiB per GPU (weights {plan['weights_bytes'] / 2**20:.1f}"
              f" + KV {plan['kv_cache_bytes'] / 2**20:.1f}), device {plan['device']}, fits {plan['fits']}")
EOF
            ;;
        grpo_async_vllm)  # rl.async with rl.vllm_mode server: trl vllm-serve on GPU 1, training on GPU 0
            if (( gpus < 2 )); then
                echo "[grpo_async_vllm] skipped: needs 2 GPUs (the vLLM server on one, training on the other), this node has $gpus"
            elif ! $PY -c "import vllm" 2>/dev/null; then
                echo "[grpo_async_vllm] skipped: vllm is not installed in this image"
            else
                d="$OUT/grpo_async_vllm"; mkdir -p "$d"
                write_llama_folder "$d/model" 512 1024 2 8  # random weights: the first sync replaces the server's
                CUDA_VISIBLE_DEVICES=1 "$(dirname "$PY")/trl" vllm-serve --model "$d/model" --port 8011 \
                    --gpu_memory_utilization 0.5 --max_model_len 1024 --enforce_eager > "$d/server.log" 2>&1 &
                server=$!
                for _ in $(seq 150); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 2; done
                set_server=(--set rl.async=true --set rl.generator=vllm --set rl.vllm_mode=server
                            --set rl.vllm_server_base_url=http://127.0.0.1:8011 --set rl.vllm_server_timeout=10)
                timeout 300 $PY -m deepspeed.launcher.runner --include localhost:0 "$ROOT/harness/run.py" \
                    --recipe zero3 --set train.objective=grpo --set precision=bf16 --set train.model="$d/model" \
                    --set train.steps=8 --set train.log_every=1 --set batch.micro_batch_per_gpu=8 \
                    --set rl.num_generations=4 --set rl.max_completion_length=16 --set optimizer.lr=3e-2 \
                    --set scheduler.type=none --set rl.max_staleness=2 --set rl.weight_sync_steps=2 "${set_server[@]}" \
                    --output-dir "$d/run" --overwrite || echo "[grpo_async_vllm] failed (exit $?; server log: $d/server.log)"
                kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
                $PY - "$d/run" <<'EOF' || true
import json, sys
rs = [r for r in map(json.loads, open(sys.argv[1] + "/metrics.jsonl")) if r["kind"] == "train"]
lines = [json.loads(x) for x in open(sys.argv[1] + "/rollouts.jsonl")]
print(f"[grpo_async_vllm] reward {rs[0]['reward']:.3f} -> {rs[-1]['reward']:.3f}, versions "
      f"{sorted({r['model_version'] for r in lines})}, staleness at most "
      f"{max(r['step'] - 1 - r['model_version'] for r in lines)} (bound 2), ratio to vLLM's log-probs "
      f"{min(r['sampling/importance_sampling_ratio/min'] for r in rs):.3f}.."
      f"{max(r['sampling/importance_sampling_ratio/max'] for r in rs):.3f}, generate wait "
      f"{sum(r['time/generate_s'] for r in rs[1:]):.2f} s, server {sum(r['time/generator_s'] for r in rs[1:]):.2f} s, "
      f"train {sum(r['time/train_s'] for r in rs[1:]):.2f} s")
EOF
                timeout 120 $PY -m deepspeed.launcher.runner --include localhost:0 "$ROOT/harness/run.py" --recipe zero3 \
                    --set train.objective=grpo --set train.model="$d/model" --set train.steps=2 "${set_server[@]}" \
                    --output-dir "$d/refused" --overwrite > "$d/refused.log" 2>&1
                echo "[grpo_async_vllm] with the server stopped: exit $? (2 expected): $(grep -m1 'vLLM server at' "$d/refused.log")"
            fi ;;
        zero2)
            timeout 450 $PY "$ROOT/bench/gpu_check.py" --out "$OUT" "$@" ;;
        pipeline|3d)
            tp=1; [[ $case == 3d ]] && tp=2
            timeout 450 $PY -m deepspeed.launcher.runner --num_gpus "$(need "$case")" "$ROOT/bench/pipe_probe.py" \
                --out "$OUT/$case" --shape tinyllama-1.1b --pp 2 --tp $tp --precision bf16 --seq-len 2048 \
                --micro-batch 2 --accum 8 --steps 12 --profile-steps 10-11
            echo "[$case]  report: $OUT/$case/report.md" ;;
        qlora)
            timeout 300 $PY -m deepspeed.launcher.runner --num_gpus 1 "$ROOT/harness/run.py" --recipe lora_zero3 \
                --set adapter.load_in_4bit=true --set "train.model=$OUT/qlora/model" --set train.steps=20 \
                --set train.seq_len=1024 --set train.eval_every=0 --output-dir "$OUT/qlora/run" --overwrite
            echo "[qlora]   run: $OUT/qlora/run (summary.json: loss, memory)" ;;
        long_context)
            # 32K tokens per row on ONE GPU (sp 1), then sp 2 over two GPUs when present: a TinyLlama-shaped model,
            # the long_context recipe (ZeRO-3, tiled loss + MLP, checkpointing), flash-attention varlen where
            # flash-attn imports, else flex_attention; the run's summary.json holds loss and peak memory.
            attn=flex_attention
            $PY -c "import flash_attn" 2>/dev/null && attn=flash_attention_2
            $PY - "$OUT/long_context" <<'EOF'
import random, sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from harness.model.hf import _shipped_eos_id, load_tokenizer
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
eos = _shipped_eos_id()
cfg = LlamaConfig(vocab_size=512, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=65536,
                  bos_token_id=eos, eos_token_id=eos)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out / "model")
load_tokenizer("tiny-llama").save_pretrained(out / "model")
words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
random.seed(0)
with open(out / "docs.txt", "w") as f:  # 40 documents of 2K-12K words: several per 32K row
    for _ in range(40):
        f.write(" ".join(random.choice(words) for _ in range(random.randint(2000, 12000))) + "\n")
EOF
            for sp in 1 2; do
                (( gpus < sp )) && { echo "[skip]    long_context sp $sp needs $sp GPUs"; continue; }
                a=$attn; (( sp > 1 )) && [[ $attn == flex_attention ]] && a=document_sdpa  # flex loses documents under SP
                timeout 600 $PY -m deepspeed.launcher.runner --num_gpus $sp "$ROOT/harness/run.py" \
                    --recipe long_context --set parallel.sequence=$sp --set train.seq_len=32768 \
                    --set "train.model=$OUT/long_context/model" --set "train.dataset=$OUT/long_context/docs.txt" \
                    --set train.attention=$a --set train.steps=6 --set train.log_every=1 --set train.eval_every=0 \
                    --set train.save_every=0 --output-dir "$OUT/long_context/sp$sp" --overwrite
                echo "[long_context] sp $sp ($a): $OUT/long_context/sp$sp/summary.json"
            done ;;
        moe)  # a ~0.5B Qwen3-MoE folder (16 experts, top 4), bf16: AutoEP with torch._grouped_mm expert GEMMs;
              # EP 2 over 2 GPUs (recipe moe_ep), else AutoEP of size 1 on one GPU (the same layer, no all-to-all)
            $PY - "$OUT/moe/model" <<'EOF'
import sys, torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
from harness.model.hf import _shipped_eos_id, load_tokenizer
eos = _shipped_eos_id()
cfg = Qwen3MoeConfig(vocab_size=512, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=768,
                     num_experts=16, num_experts_per_tok=4, num_hidden_layers=8, num_attention_heads=16,
                     num_key_value_heads=4, head_dim=64, bos_token_id=eos, eos_token_id=eos)
torch.manual_seed(0)
Qwen3MoeForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])
load_tokenizer("tiny-llama").save_pretrained(sys.argv[1])
EOF
            n=1; ep=(--set parallel.expert=1 --set 'deepspeed.expert_parallel={"enabled": true, "autoep_size": 1}')
            if (( gpus >= 2 )); then n=2; ep=(--set parallel.expert=2); fi
            timeout 300 $PY -m deepspeed.launcher.runner --num_gpus $n "$ROOT/harness/run.py" --recipe moe_ep \
                "${ep[@]}" --set "train.model=$OUT/moe/model" --set train.steps=20 --set train.seq_len=1024 \
                --set train.eval_every=0 --profile-steps 15-16 --output-dir "$OUT/moe/run" --overwrite
            echo "[moe]     run: $OUT/moe/run (summary.json: lm_loss, aux_loss, tokens/s, all_to_all bytes)" ;;
        vlm)  # vision-language (docs/vision-language.md): a ~0.6B Qwen2-VL folder (bench/vlm.py --size small), every
              # other record one 448x448 image, ZeRO-3 on up to 2 GPUs (a rank regularly has text only: the placeholder
              # call), vision tower trained and frozen; per-rank peak memory beside the planner, images/s
            n=1; (( gpus >= 2 )) && n=2
            timeout 420 $PY "$ROOT/bench/vlm.py" --size small --ranks $n --recipe zero3 --steps 12 --records 96 \
                --image-size 448 --keep "$OUT/vlm" || echo "[vlm]     failed (exit $?)"
            echo "[vlm]     runs: $OUT/vlm/{trained,frozen} (summary.json: memory, throughput)" ;;
        vlm_video)  # the same with an 8-frame 448x448 video before each image (harness/data/video.py): images and
                    # video through one tower call per micro-batch on the ranks that have them, ZeRO-3
            n=1; (( gpus >= 2 )) && n=2
            timeout 420 $PY "$ROOT/bench/vlm.py" --size small --ranks $n --recipe zero3 --steps 12 --records 96 \
                --image-size 448 --video-frames 8 --keep "$OUT/vlm_video" || echo "[vlm_video] failed (exit $?)"
            echo "[vlm_video] runs: $OUT/vlm_video/{trained,frozen} (summary.json: memory, throughput)" ;;
        vlm_packing)  # packed VL rows (docs/vision-language.md#packing-and-document-masking) on one GPU, fp32: the
              # summed loss of 48 conversations packed into rows of 2048 equals one per row under each attention that
              # keeps documents apart (flash varlen where installed: micro-batch 1, as here), and conversations/s
            for attn in sdpa flex_attention flash_attention_2; do
                timeout 120 $PY "$ROOT/bench/vlm_packing.py" --size small --device cuda --attention $attn \
                    --seq-len 2048 --image-size 448 --records 48 --repeats 1 || echo "[vlm_packing] $attn failed (exit $?)"
            done  # and Gemma 3's packed masks (harness/model/vision_masks.py) as a BlockMask, loss + grads to 1e-6
            timeout 120 $PY "$ROOT/bench/vlm_gemma_packing.py" --device cuda --attention sdpa eager flex_attention \
                || echo "[vlm_gemma_packing] failed (exit $?)" ;;
        dpo)  # preference optimisation: the reference as a frozen engine (zero2) and as the base, adapters off (LoRA)
            $PY - "$OUT/dpo" <<'EOF'
import json, random, sys, torch
from pathlib import Path
from transformers import LlamaConfig, LlamaForCausalLM
from harness.model.hf import _shipped_eos_id, load_tokenizer
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
eos = _shipped_eos_id()
cfg = LlamaConfig(vocab_size=512, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                  num_attention_heads=32, num_key_value_heads=4, bos_token_id=eos, eos_token_id=eos)
torch.manual_seed(0)
LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out / "model")
load_tokenizer("tiny-llama").save_pretrained(out / "model")
words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
random.seed(0)
text = lambda lo, hi: " ".join(random.choice(words) for _ in range(random.randint(lo, hi)))
with open(out / "pairs.jsonl", "w") as f:  # prompt + completion stay under seq 1024 tokens
    for _ in range(300):
        f.write(json.dumps({"prompt": text(20, 200), "chosen": text(10, 300), "rejected": text(10, 300)}) + "\n")
EOF
            for mode in precomputed engine adapter; do
                recipe=zero2; [[ $mode == adapter ]] && recipe=lora_zero2
                timeout 180 $PY -m deepspeed.launcher.runner --num_gpus 1 "$ROOT/harness/run.py" --recipe $recipe \
                    --set train.objective=dpo --set preference.reference_mode=$mode \
                    --set "train.model=$OUT/dpo/model" --set "train.dataset=$OUT/dpo/pairs.jsonl" --set train.steps=10 \
                    --set train.seq_len=1024 --set train.log_every=1 --set train.eval_every=0 --set train.save_every=0 \
                    --output-dir "$OUT/dpo/$mode" --overwrite || echo "[dpo]     $mode run failed (exit $?)"
                $PY - "$OUT/dpo/$mode/summary.json" "$mode" <<'EOF' || true
import json, sys
s = json.load(open(sys.argv[1]))
mem = s.get("memory", {})
print(f"[dpo]     {sys.argv[2]}: loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}; peak per rank "
      f"{mem.get('peak_per_rank')}; planner {mem.get('predicted_peak_total_per_rank')}")
EOF
            done ;;
        fp16)  # fp16 with DeepSpeed's dynamic loss scaling (GPU only), ZeRO-2 and ZeRO-3 on the built-in tiny model
            for recipe in zero2 zero3; do
                timeout 120 $PY -m deepspeed.launcher.runner --num_gpus 1 "$ROOT/harness/run.py" --recipe $recipe \
                    --set precision=fp16 --set train.steps=30 --set train.seq_len=512 --set train.log_every=10 \
                    --set train.eval_every=0 --set train.save_every=15 --output-dir "$OUT/fp16/$recipe" --overwrite \
                    || echo "[fp16]    $recipe run failed (exit $?)"
            done ;;
        stream)  # train.streaming on CUDA ranks: a CUDA rank spawns the writer; the run on the store while it is
                 # written, then on the same store finished (`harness data prepare`): the same losses step for step
            st=(--set train.streaming=true --set train.stream_shard_tokens=65536 --set train.seq_len=512
                --set "train.store_dir=$OUT/stream/stores")
            rm -rf "$OUT/stream"
            for run in live finished; do
                [[ $run == finished ]] && $PY -m harness.cli data prepare --model tiny-llama --seq-len 512 \
                    --out "$OUT/stream/stores" --set train.streaming=true --set train.stream_shard_tokens=65536
                timeout 180 $PY -m deepspeed.launcher.runner --num_gpus "$gpus" "$ROOT/harness/run.py" --recipe zero2 \
                    "${st[@]}" --set train.steps=40 --set train.log_every=10 --set train.eval_every=0 \
                    --set train.save_every=0 --output-dir "$OUT/stream/$run" --overwrite || echo "[stream]  $run failed"
            done
            $PY - "$OUT/stream" <<'EOF' || true
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
loss = {r: [json.loads(l)["loss"] for l in open(out / r / "metrics.jsonl") if '"kind": "train"' in l] for r in ("live", "finished")}
wait = json.load(open(out / "live" / "summary.json")).get("stream_wait_s")
print(f"[stream]  losses equal step for step: {loss['live'] == loss['finished']} ({len(loss['live'])} steps); "
      f"rank 0 waited {wait} s for the writer")
EOF
            ;;
        mixture)  # train.datasets on NCCL: builtin text + generated instruction records, weights 0.7 / 0.3, bf16
                  # ZeRO-2 on up to 2 GPUs; loss/<name> and rows/<name> from the device sums (harness/train/mixture.py)
            n=1; (( gpus >= 2 )) && n=2
            $PY - "$OUT/mixture" <<'EOF'
import json, random, sys
from pathlib import Path
out = Path(sys.argv[1]); out.mkdir(parents=True, exist_ok=True)
random.seed(0)
words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
with open(out / "inst.jsonl", "w") as f:
    for _ in range(2000):
        q = " ".join(random.choice(words) for _ in range(random.randint(5, 40)))
        f.write(json.dumps({"prompt": f"Reverse: {q}\nAnswer:", "response": " " + " ".join(reversed(q.split()))}) + "\n")
EOF
            mix='[{"dataset": "builtin", "weight": 0.7, "name": "web"}, {"dataset": "'"$OUT/mixture/inst.jsonl"'", "format": "instruction", "weight": 0.3, "name": "inst"}]'
            timeout 180 $PY -m deepspeed.launcher.runner --num_gpus $n "$ROOT/harness/run.py" --recipe zero2 \
                --set "train.datasets=$mix" --set train.steps=20 --set train.seq_len=256 --set train.log_every=5 \
                --set train.eval_every=10 --set train.save_every=0 --output-dir "$OUT/mixture/run" --overwrite \
                || echo "[mixture] run failed (exit $?)"
            $PY - "$OUT/mixture/run/metrics.jsonl" <<'EOF' || true
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
train = [r for r in rows if r["kind"] == "train"]
read, worst = {"web": 0, "inst": 0}, 0.0
for r in train:
    for n in read:
        read[n] += r[f"rows/{n}"]
    total = sum(read.values())
    worst = max(worst, abs(read["web"] - 0.7 * total), abs(read["inst"] - 0.3 * total))
last, evals = train[-1], [r for r in rows if r["kind"] == "eval"][-1]
print(f"[mixture] {len(train)} steps: loss/web {last.get('loss/web')}, loss/inst {last.get('loss/inst')}; rows read "
      f"{read} (worst |count - weight x rows| {worst:.2f}, must be < 1); eval_loss/web {evals.get('eval_loss/web')}, "
      f"eval_loss/inst {evals.get('eval_loss/inst')}")
EOF
            ;;
        grpo)  # online RL on the toy task: hf generation in the loop, nccl gathers, bf16, ZeRO-2 and ZeRO-3 (+ a KL)
            for recipe in zero2 zero3; do
                timeout 150 $PY -m deepspeed.launcher.runner --num_gpus 1 "$ROOT/harness/run.py" --recipe $recipe \
                    --set train.objective=grpo --set precision=bf16 --set train.steps=20 --set train.log_every=5 \
                    --set train.save_every=10 --set batch.micro_batch_per_gpu=16 --set batch.grad_accum_steps=2 \
                    --set rl.num_generations=8 --set rl.max_completion_length=32 --set rl.beta=0.04 \
                    --set optimizer.lr=3e-3 --set scheduler.type=none --output-dir "$OUT/grpo/$recipe" --overwrite \
                    || echo "[grpo]    $recipe run failed (exit $?)"
                $PY - "$OUT/grpo/$recipe/metrics.jsonl" "$recipe" <<'EOF' || true
import json, sys
rs = [r for r in map(json.loads, open(sys.argv[1])) if r["kind"] == "train"]
split = {k: sum(r[f"time/{k}_s"] for r in rs) / len(rs) for k in ("generate", "score", "reference", "train", "sync")}
print(f"[grpo]    {sys.argv[2]}: reward {rs[0]['reward']:.3f} -> {rs[-1]['reward']:.3f}, kl {rs[-1].get('kl')}, "
      f"per step " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in split.items()))
EOF
            done ;;
        ddp_fp32)  # ZeRO-0 fp32 on CUDA: the global grad norm harness/train/zero0_step.py measures (float64, fused)
            timeout 150 $PY -m deepspeed.launcher.runner --num_gpus 1 "$ROOT/harness/run.py" --recipe ddp \
                --set precision=fp32 --set train.steps=5 --set train.log_every=1 --set train.eval_every=0 \
                --output-dir "$OUT/ddp_fp32" --overwrite || echo "[ddp_fp32] run failed (exit $?)"
            $PY - "$OUT/ddp_fp32/metrics.jsonl" <<'EOF' || true
import json, sys
rs = [r for r in map(json.loads, open(sys.argv[1])) if r["kind"] == "train"]
norms = [r["grad_norm"] for r in rs]
print(f"[ddp_fp32] grad norms {norms} ({'all reported' if None not in norms else 'MISSING'}), "
      f"loss {rs[0]['loss']:.4f} -> {rs[-1]['loss']:.4f}")
EOF
            ;;
        distill)  # gkd: the teacher as a frozen engine on CUDA, ZeRO-3-sharded (zero3) and a whole copy (zero2)
            write_llama_folder "$OUT/distill/teacher" 1024 2816 24 16  # ~0.3B: a teacher beside tiny-llama
            for recipe in zero2 zero3; do
                timeout 150 $PY -m deepspeed.launcher.runner --num_gpus 1 "$ROOT/harness/run.py" --recipe $recipe \
                    --set train.objective=gkd --set distill.lmbda=0 --set precision=bf16 --set train.steps=10 \
                    --set "distill.teacher_model_name_or_path=$OUT/distill/teacher" --set train.seq_len=256 \
                    --set train.log_every=5 --set train.eval_every=0 --set train.save_every=0 \
                    --output-dir "$OUT/distill/$recipe" --overwrite || echo "[distill] $recipe run failed (exit $?)"
                $PY - "$OUT/distill/$recipe" "$recipe" <<'EOF' || true
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
rs = [r for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"]
s = json.load(open(run / "summary.json"))
teacher = sum(r["time/teacher_s"] for r in rs) / len(rs)
train = sum(r["time/train_s"] for r in rs) / len(rs)
print(f"[distill] {sys.argv[2]}: loss {rs[0]['loss']:.4f} -> {rs[-1]['loss']:.4f}, teacher entropy "
      f"{rs[-1]['teacher_entropy']:.3f}, per step teacher {teacher * 1000:.0f} ms, train {train * 1000:.0f} ms; "
      f"peak per rank {s.get('memory', {}).get('peak_per_rank')}")
EOF
            done
            # on-policy on ZeRO-3: the student's completions from HF generate (lmbda 0.5 with seq_kd: the teacher
            # engine generates the other rows), then all from a colocated vLLM (distill.use_vllm; skipped without it)
            for gen in hf vllm; do
                if [[ $gen == vllm ]] && ! $PY -c "import vllm" 2>/dev/null; then
                    echo "[distill] on-policy vllm skipped: vllm is not installed"; continue
                fi
                extra=(--set distill.lmbda=0.5 --set distill.seq_kd=true)
                [[ $gen == vllm ]] && extra=(--set distill.lmbda=1 --set distill.use_vllm=true)
                timeout 300 $PY -m deepspeed.launcher.runner --num_gpus 1 "$ROOT/harness/run.py" --recipe zero3 \
                    --set train.objective=gkd "${extra[@]}" --set distill.max_new_tokens=64 --set precision=bf16 \
                    --set train.steps=6 --set "distill.teacher_model_name_or_path=$OUT/distill/teacher" \
                    --set train.seq_len=256 --set train.log_every=1 --set train.eval_every=0 --set train.save_every=3 \
                    --output-dir "$OUT/distill/on_policy_$gen" --overwrite || echo "[distill] on-policy $gen failed (exit $?)"
                $PY - "$OUT/distill/on_policy_$gen" "$gen" <<'EOF' || true
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
rs = [r for r in map(json.loads, open(run / "metrics.jsonl")) if r["kind"] == "train"]
lines = [json.loads(x) for x in open(run / "rollouts.jsonl")]
gen = sum(r["time/generate_s"] for r in rs) / len(rs)
print(f"[distill] on-policy {sys.argv[2]}: loss {rs[0]['loss']:.4f} -> {rs[-1]['loss']:.4f}, generate {gen * 1000:.0f} "
      f"ms per step, {len(lines)} completions in rollouts.jsonl ({sum(x['source'] == 'teacher' for x in lines)} "
      f"the teacher's), mean length {sum(len(x['completion_ids']) for x in lines) / max(len(lines), 1):.1f}")
EOF
            done ;;
        ray_gpu)  # harness ray on a one-node Ray cluster that holds the GPUs: a bundle of GPUs in the placement
            # group, Ray's GPU ids handed to DeepSpeed's launcher by --include (harness/commands/ray_attempt.py);
            # skips itself without ray (the `ray` extra; not in the GPU image unless its wheel is brought along)
            if ! $PY -c "import ray" 2>/dev/null; then echo "[ray_gpu] skipped: ray is not installed"; continue; fi
            n=1; (( gpus >= 2 )) && n=2
            port=$((6379 + RANDOM % 1000)); raytmp=$(mktemp -d /tmp/dshrayXXXX)
            RAY_USAGE_STATS_ENABLED=0 $PY -m ray.scripts.scripts start --head --port $port --node-ip-address 127.0.0.1 \
                --num-gpus $n --num-cpus 2 --object-store-memory 200000000 --disable-usage-stats \
                --include-dashboard=false --temp-dir "$raytmp" >/dev/null
            timeout 300 $PY -m harness.cli ray --address 127.0.0.1:$port --nodes 1 --gpus-per-node $n \
                harness/run.py --recipe zero3 --set train.model=tiny-llama --set train.steps=10 --set train.eval_every=0 \
                --output-dir "$OUT/ray_gpu" --overwrite || echo "[ray_gpu] harness ray failed (exit $?)"
            RAY_USAGE_STATS_ENABLED=0 $PY -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true  # this machine's only Ray
            rm -rf "$raytmp"
            $PY - "$OUT/ray_gpu/metrics.jsonl" <<'EOF' || true
import json, sys
train = [r for r in map(json.loads, open(sys.argv[1])) if r["kind"] == "train"]
print(f"[ray_gpu] {len(train)} steps on the GPUs Ray gave, loss {train[0]['loss']:.3f} -> {train[-1]['loss']:.3f}")
EOF
            ;;
        optimizers)  # fewer bytes per parameter on CUDA: AdamW fp32 states, bf16 master + states (round to nearest,
            # stochastic: torchao's compiled step), Muon (ZeRO-2)
            for recipe in zero2 zero2_bf16_states zero2_bf16_sr zero2_muon; do
                timeout 150 $PY -m deepspeed.launcher.runner --num_gpus "$gpus" "$ROOT/harness/run.py" --recipe $recipe \
                    --set train.steps=30 --set train.seq_len=512 --set train.log_every=10 --set train.eval_every=0 \
                    --set train.save_every=31 --profile-steps 30-30 --output-dir "$OUT/optimizers/$recipe" --overwrite \
                    || echo "[optim]   $recipe run failed (exit $?)"
                $PY - "$OUT/optimizers/$recipe/summary.json" "$recipe" <<'EOF' || true
import json, sys
s = json.load(open(sys.argv[1]))
mem, t = s.get("memory", {}), s.get("throughput", {})
states = [sum(sum(v.values()) for v in r.values()) for r in mem.get("model_states_per_rank", [])]
planned = [sum(sum(v.values()) for v in r.values()) for r in mem.get("predicted_after_step_per_rank", [])]
print(f"[optim]   {sys.argv[2]}: loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, "
      f"{t.get('tokens_per_s_median')} tokens/s, peak per rank {mem.get('peak_per_rank')}, "
      f"model states per rank {states} (planner {planned})")
EOF
            done ;;
        fp8)  # FP8 matmuls (torchao float8) against bf16 ones, ZeRO-2, the ~1B folder model
            for mode in bf16 fp8; do
                flag=false; [[ $mode == fp8 ]] && flag=true
                timeout 200 $PY -m deepspeed.launcher.runner --num_gpus "$gpus" "$ROOT/harness/run.py" --recipe zero2 \
                    --set "train.model=$OUT/qlora/model" --set train.fp8=$flag --set train.steps=30 \
                    --set train.seq_len=2048 --set train.log_every=10 --set train.eval_every=0 \
                    --set train.save_every=31 --output-dir "$OUT/fp8/$mode" --overwrite \
                    || echo "[fp8]     $mode run failed (exit $?)"
                $PY - "$OUT/fp8/$mode/summary.json" "$mode" <<'EOF' || true
import json, sys
s = json.load(open(sys.argv[1]))
mem, t = s.get("memory", {}), s.get("throughput", {})
print(f"[fp8]     {sys.argv[2]} matmuls: loss {s['first_loss']:.4f} -> {s['last_loss']:.4f}, "
      f"{t.get('tokens_per_s_median')} tokens/s, peak per rank {mem.get('peak_per_rank')}")
EOF
            done ;;
        *) echo "error: unknown case $case (zero2, pipeline, 3d, qlora, long_context, moe, dpo, fp16, stream, mixture, grpo, grpo_vllm, grpo_async, grpo_async_vllm, grpo_tools, vlm, vlm_video, vlm_packing, ddp_fp32, distill, distill_served, ray_gpu, optimizers, fp8)" >&2; exit 2 ;;
    esac
done
echo "[gpu]     check took $(( $(date +%s) - start )) s; reports under $OUT"
