"""`harness export CKPT --out DIR`: a Hugging Face model folder from a DeepSpeed checkpoint, streamed shard by
shard (sharded safetensors + index, as save_pretrained writes them)."""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from harness.checkpoint.export.folder import DEFAULT_SHARD_SIZE
    from harness.config.defaults import PRECISION_DTYPES

    parser.add_argument("checkpoint", metavar="CKPT", help="run folder, its checkpoints/ folder, or global_stepN")
    parser.add_argument("--out", required=True, help="output folder (must be new or empty)")
    parser.add_argument("--overwrite", action="store_true", help="write into a non-empty --out")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE,
                        help=f"largest safetensors file, e.g. 5GB, 200MB (default {DEFAULT_SHARD_SIZE}, as HF)")
    parser.add_argument("--dtype", choices=sorted(PRECISION_DTYPES), default=None,
                        help="weights' dtype in the folder (default: the dtype the run trained in)")
    parser.add_argument("--adapter-only", action="store_true",
                        help="LoRA runs: a peft adapter folder (adapter_config.json + adapter_model.safetensors) "
                             "instead of the merged model")


def run(args: argparse.Namespace) -> int:
    from harness.checkpoint.export.folder import export

    info = export(args.checkpoint, args.out, args.overwrite, max_shard_size=args.max_shard_size, dtype=args.dtype,
                  adapter_only=args.adapter_only)
    check = ("not verified (no probe.pt in the checkpoint)" if info["max_logit_diff"] is None else
             f"verified against the engine: max |logit diff| {info['max_logit_diff']:.2e} (limit {info['tolerance']})")
    layout = f"ZeRO-{info['zero_stage']}, tp {info['tp']}, pp {info['pp']}, step {info['step']}"
    print(f"[export] {info['checkpoint']} ({layout}) -> {info['out']}")
    print(f"[export] {info['shards']} safetensors file(s), {info['total_size_bytes'] / 1e6:.1f} MB in "
          f"{info['dtype']}, {info['seconds']:.1f} s")
    print(f"[export] {check}")
    if info.get("adapter_only"):
        print(f"[export] {info['tensors']} adapter tensors ({info['adapter_params']:,} params); load with "
              f"PeftModel.from_pretrained(base, {info['out']!r})")
    else:
        from transformers import AutoConfig

        from harness.model.hf import auto_class

        name = auto_class(AutoConfig.from_pretrained(info["out"])).__name__  # a reward model, a vision-language model
        print(f"[export] load with {name}.from_pretrained({info['out']!r})")
    return 0
