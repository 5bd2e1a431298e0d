"""A standalone DeepSpeed PipelineEngine run through the harness's profiling hooks (no trainer, no data files).

What it is for: checking the planner's pipeline math (stage partition, per-stage model states, p2p bytes,
bubble) and the profiling hooks against a live PipelineEngine, independent of the harness's HF -> pipeline
conversion. The PipelineModule is built the way the harness lays a Llama-family model out: token embedding,
one layer per decoder block (HF's own LlamaDecoderLayer), final norm, LM head; with tied embeddings the head
is a TiedLayerSpec sharing the embedding (held by the first and the last stage). Batches are random token ids.

    deepspeed --num_gpus 2 bench/pipe_probe.py --out /tmp/pipe_probe            (CPU: 2 ranks, gloo)
    deepspeed --num_gpus 4 bench/pipe_probe.py --out /tmp/pipe_probe --pp 2     (pipeline 2 x data 2)
    deepspeed --num_gpus 4 bench/pipe_probe.py --out /tmp/pipe_probe --tp 2     (3D: pipeline 2 x tensor 2)

Leaves metrics.jsonl, summary.json, ds_config.json and report.md in --out, like a harness run.
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


def pipeline_module(cfg: dict, pp: int, partition: str, topology=None):
    """tiny Llama-family HF config -> PipelineModule [embed, block x L, norm, head]; loss on the last stage."""
    import torch
    import transformers
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from torch import nn
    from transformers.models.llama import modeling_llama as ml

    fields = dict(cfg)
    config = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    config._attn_implementation = "sdpa"  # causal without a mask

    class Block(nn.Module):
        def __init__(self, index):
            super().__init__()
            self.layer = ml.LlamaDecoderLayer(config, index)
            self.rotary = ml.LlamaRotaryEmbedding(config)

        def forward(self, hidden):
            positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
            return self.layer(hidden, position_embeddings=self.rotary(hidden, positions))

    def head(embedding, hidden):
        return nn.functional.linear(hidden, embedding.weight)

    def loss_fn(logits, labels):
        return nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))

    h, vocab = config.hidden_size, config.vocab_size
    tied = bool(cfg.get("tie_word_embeddings", False))
    embed = TiedLayerSpec("embed", nn.Embedding, vocab, h) if tied else LayerSpec(nn.Embedding, vocab, h)
    layers = [embed, *[LayerSpec(Block, i) for i in range(config.num_hidden_layers)],
              LayerSpec(ml.LlamaRMSNorm, h, eps=config.rms_norm_eps),
              TiedLayerSpec("embed", nn.Embedding, vocab, h, forward_fn=head) if tied
              else LayerSpec(nn.Linear, h, vocab, bias=False)]
    kwargs = {"topology": topology} if topology is not None else {"num_stages": pp}
    module = PipelineModule(layers=layers, loss_fn=loss_fn, partition_method=partition, **kwargs)
    module.config = config  # the planner's shape source (profiling/live.py reads module.config)
    tp = module._grid.get_slice_parallel_world_size()
    if tp > 1:  # 3D: split this stage's blocks over the topology's model-parallel group, after the build
        from harness.model.parallel.tensor import shard_decoder_layer

        group, rank = module._grid.get_slice_parallel_group(), module._grid.get_slice_parallel_rank()
        for layer in module.forward_funcs:
            if isinstance(layer, Block):
                shard_decoder_layer(layer.layer, config, group, rank, tp)
    return module


def ds_config(args, world: int) -> dict:
    dp = world // (args.pp * args.tp)
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": args.accum,
            "train_batch_size": args.micro_batch * args.accum * dp, "steps_per_print": 10**6,
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 1, "reduce_bucket_size": 64 * 64},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "bf16": {"enabled": args.precision == "bf16"},
            "pipeline": {"partition": args.partition}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="/tmp/pipe_probe")
    p.add_argument("--shape", default="tiny-llama", help="a Llama-family shape from harness.model_shapes")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--tp", type=int, default=1, help="tensor parallel inside each stage (3D)")
    p.add_argument("--layers", type=int, help="override num_hidden_layers")
    p.add_argument("--tied", action="store_true", help="tie the LM head to the embedding")
    p.add_argument("--partition", default="parameters", choices=["parameters", "uniform"])
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--accum", type=int, default=4, help="micro-batches per step (m)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--profile-steps", default="2-3")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--local_rank", type=int, default=0)  # the deepspeed launcher appends it
    args = p.parse_args(argv)

    import deepspeed
    import torch

    from harness import profiling
    from harness.model_shapes import load_model_config
    from harness import dist as distmod
    from harness.train.metrics import MetricsLog

    dist = distmod.init()
    cfg = load_model_config(args.shape)
    cfg["tie_word_embeddings"] = args.tied
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    run_dir = Path(args.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    recipe = {"precision": args.precision, "activation_checkpointing": False, "monitor": {},
              "profile": {"steps": args.profile_steps, "memory": True},
              "train": {"model": args.shape, "seq_len": args.seq_len, "steps": args.steps,
                        "packing": "concat"}}  # the probe's layers pass hidden states only (no position ids)
    from harness.config.recipes import complete

    # the spec's recipe is complete like a launch's (the planner's RunModel reads every key); recipe.json keeps the
    # probe's own keys
    full = complete({**recipe, "description": "pipeline probe",
                     "parallel": {"pipeline": args.pp, "tensor": args.tp, "partition_method": args.partition}},
                    "pipe_probe")
    spec = SimpleNamespace(recipe=full, recipe_name="pipe_probe", world_size=dist.world_size,
                           dp=dist.world_size // (args.pp * args.tp), tp=args.tp, pp=args.pp, ds_config=ds_config(args, dist.world_size))
    spec.ds_config = {**spec.ds_config, **profiling.ds_overrides(spec, run_dir)}
    if dist.is_main:
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        (run_dir / "recipe.json").write_text(json.dumps(recipe, indent=2))
        (run_dir / "ds_config.json").write_text(json.dumps(spec.ds_config, indent=2))
    log = MetricsLog(run_dir, enabled=dist.is_main)
    torch.manual_seed(1234)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    topology = PipeModelDataParallelTopology(num_pp=args.pp, num_mp=args.tp, num_dp=spec.dp)
    module = pipeline_module(cfg, args.pp, args.partition, topology)
    if args.precision == "bf16":
        module = module.to(torch.bfloat16)
    engine, *_ = deepspeed.initialize(model=module, model_parameters=[q for q in module.parameters()],
                                      config=spec.ds_config)
    hooks = profiling.make_hooks(spec, engine, dist, run_dir, log)
    gen = torch.Generator().manual_seed(0)
    result: dict = {"parts": [int(x) for x in module.parts]}

    def batches():
        while True:
            ids = torch.randint(0, cfg["vocab_size"], (args.micro_batch, args.seq_len), generator=gen)
            yield ids, ids

    data = batches()
    for step in range(args.steps):
        for hook in hooks:
            hook.before_step(step)
        start = time.perf_counter()
        loss = engine.train_batch(data).item()
        record = {"loss": loss, "step_time_s": time.perf_counter() - start}
        for hook in hooks:
            record.update(hook.after_step(step) or {})
        log.write("train", step + 1, **record)
    for hook in hooks:
        result.update(hook.close() or {})
    log.close()
    if dist.is_main:
        summary = {"run_dir": str(run_dir), "recipe": "pipe_probe", "world_size": dist.world_size,
                   "steps": args.steps, "start_step": 0, **result}
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        from harness.report import write_report

        print(f"[report]  {write_report(run_dir)}")
    distmod.teardown()
    return 0


if __name__ == "__main__":
    from harness.dist import exit_now

    exit_now(main())  # as harness/run.py ends: no interpreter finalization after the process group (see exit_now)
