"""GPU check: a ~1B Llama-shaped model, bf16, ZeRO-2, seq 2048, on one GPU, through the harness's hooks.

Prints tokens/s, TFLOP/s, MFU and the planner's predicted peak memory next to the measured one (and the
model-state bytes term by term), and leaves a run folder with metrics.jsonl, summary.json and report.md.
Started by bench/gpu_check.sh, which installs DeepSpeed from prepared wheels first; see that file.

Needs only torch (CUDA), transformers and deepspeed: no datasets, tokenizer, jsonschema or network. So
the DeepSpeed config is the committed ds_configs/zero2.json with its "auto" values filled the way
harness/config/resolve.py fills them (train_batch_size = micro x accum x world, reduce_bucket_size = hidden^2),
torch's AdamW instead of DeepSpeed's fused one (that one is compiled on first use and needs nvcc), and
the batches are random token ids (throughput and memory do not depend on the text).

    python bench/gpu_check.py --out /tmp/gpu_check                     (on the GPU)
    python bench/gpu_check.py --shape tiny-llama --seq-len 64 --steps 6 --profile-steps 3-4 --allow-cpu
                                                                       (a smoke test of this script on CPU)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEFAULT_SHAPE = "tinyllama-1.1b"  # Llama-2 architecture, 1.10B params (harness.model_shapes.KNOWN)


def shape_config(name: str) -> dict:
    from harness.model_shapes import KNOWN, PRESETS

    table = {**KNOWN, **PRESETS}
    if name not in table:
        sys.exit(f"error: unknown shape {name!r}; known: {', '.join(sorted(table))}")
    return dict(table[name])


def ds_config(hidden: int, micro: int, steps: int, world: int) -> dict:
    ds = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    ds.pop("$schema", None)
    ds["train_micro_batch_size_per_gpu"] = micro
    ds["train_batch_size"] = micro * ds["gradient_accumulation_steps"] * world
    ds["zero_optimization"]["reduce_bucket_size"] = hidden * hidden
    ds["optimizer"]["params"]["torch_adam"] = True
    sched = ds.get("scheduler", {}).get("params", {})
    if "total_num_steps" in sched:
        sched["total_num_steps"] = steps
        sched["warmup_num_steps"] = min(sched.get("warmup_num_steps", 0), steps)
    return ds


def build_model(cfg: dict, device: str):
    import torch
    import transformers

    fields = dict(cfg)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(1234)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")


def train(engine, hooks, log, args, vocab: int, device: str) -> dict:
    import torch

    gen = torch.Generator().manual_seed(0)
    tokens_per_step = args.micro_batch * args.seq_len
    first = last = None
    for step in range(args.steps):
        for hook in hooks:
            hook.before_step(step)
        start = time.perf_counter()
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len), generator=gen).to(device)
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        value = loss.detach().float().item()  # synchronizes, as the trainer does
        elapsed = time.perf_counter() - start
        record = {"loss": value, "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed,
                  "samples_per_s": args.micro_batch / elapsed}
        for hook in hooks:
            record.update(hook.after_step(step) or {})
        log.write("train", step + 1, **record)
        first = value if first is None else first
        last = value
        print(f"[step]    {step + 1}/{args.steps} loss {value:.4f} {record['tokens_per_s']:.0f} tok/s "
              f"{record.get('memory', {}).get('peak_allocated_bytes', 0) / 2**30:.2f} GiB peak", flush=True)
    return {"first_loss": first, "last_loss": last}


def show(summary: dict) -> None:
    t, mem = summary["throughput"], summary["memory"]
    mfu = f"{100 * t['mfu']:.1f}%" if t.get("mfu") is not None else f"n/a ({t.get('mfu_note')})"
    print(f"[gpu]     {t['device_name']}: {t['tokens_per_s_median']:.0f} tokens/s, "
          f"{t['tflops_per_gpu']:.1f} TFLOP/s, MFU {mfu} (peak {t['peak_tflops']} TFLOP/s bf16 dense, "
          f"{t['flops_per_token']:.3g} FLOPs/token)")
    predicted = mem["predicted"].get("peak_total_bytes")
    key = "peak_allocated_bytes" if mem["device"] == "cuda" else "peak_rss_bytes"
    measured = mem["peak_per_rank"][0].get(key)
    ratio = f"{measured / predicted:.3f}" if predicted and measured else "n/a"
    print(f"[memory]  peak: planner predicts {predicted / 2**30:.2f} GiB (model states at peak + activations), "
          f"measured {measured / 2**30:.2f} GiB ({key}); measured/predicted = {ratio}")
    after = mem["predicted"]["after_step"]
    for term, devices in mem["model_states_per_rank"][0].items():
        got, want = sum(devices.values()), sum(after.get(term, {}).values())
        print(f"[memory]  model states {term:<18} predicted {want / 2**30:8.3f} GiB  measured {got / 2**30:8.3f} GiB")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/gpu_check", help="run folder to write")
    p.add_argument("--shape", default=DEFAULT_SHAPE, help="model shape from harness.model_shapes")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--profile-steps", default="10-12")
    p.add_argument("--allow-cpu", action="store_true", help="run without a GPU (smoke test of this script)")
    args = p.parse_args(argv)

    import deepspeed
    import torch

    from harness import dist as distmod
    from harness import profiling
    from harness.train.metrics import MetricsLog

    if not torch.cuda.is_available() and not args.allow_cpu:
        sys.exit("error: no CUDA device visible (torch.cuda.is_available() is False); --allow-cpu to smoke-test")
    dist = distmod.init()
    cfg = shape_config(args.shape)
    run_dir = Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    recipe = {"precision": "bf16", "activation_checkpointing": False, "monitor": {},
              "profile": {"steps": args.profile_steps, "memory": True},
              "train": {"model": args.shape, "seq_len": args.seq_len, "steps": args.steps}}
    from harness.config.recipes import complete

    # the spec's recipe is complete like a launch's (the run's prediction builds the planner's RunModel from every
    # key); recipe.json keeps the check's own keys
    full = complete({**recipe, "description": "GPU check"}, "gpu_check")
    spec = SimpleNamespace(recipe=full, recipe_name="zero2", world_size=dist.world_size, dp=dist.world_size,
                           tp=1, pp=1, ds_config=ds_config(cfg["hidden_size"], args.micro_batch, args.steps,
                                                           dist.world_size))
    spec.ds_config = {**spec.ds_config, **profiling.ds_overrides(spec, run_dir)}  # new top-level keys only
    (run_dir / "recipe.json").write_text(json.dumps(recipe, indent=2))
    (run_dir / "ds_config.json").write_text(json.dumps(spec.ds_config, indent=2))
    log = MetricsLog(run_dir, enabled=dist.is_main)
    try:
        model = build_model(cfg, dist.device)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"[model]   {args.shape}: {n_params / 1e9:.3f}B params, seq {args.seq_len}, micro batch "
              f"{args.micro_batch}, bf16, ZeRO-2, {dist.world_size} rank(s) on {dist.device}", flush=True)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()),
                                          config=spec.ds_config)
        hooks = profiling.make_hooks(spec, engine, dist, run_dir, log)
        result = train(engine, hooks, log, args, cfg["vocab_size"], dist.device)
        for hook in hooks:
            result.update(hook.close() or {})
    finally:
        log.close()
    if dist.is_main:
        summary = {"run_dir": str(run_dir), "recipe": "zero2", "world_size": dist.world_size, "steps": args.steps,
                   "start_step": 0, **result}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        show(summary)
        from harness.report import write_report

        print(f"[report]  {write_report(run_dir)}")
    distmod.teardown()
    return 0


if __name__ == "__main__":
    from harness.dist import exit_now

    exit_now(main())  # as harness/run.py ends: no interpreter finalization after the process group (see exit_now)
