"""bf16 master weights with and without stochastic rounding, under DeepSpeed ZeRO-2 (docs/optimizers.md):
DeepSpeed's AdamW with fp32 master and states, DeepSpeed's AdamW with bf16 master + states (round to nearest), and
torchao 0.18's `_AdamW(bf16_stochastic_round=True)` as DeepSpeed's client optimizer on the same bf16 master + states.

    python bench/stochastic_rounding.py [--ranks 2] [--steps 200] [--hidden 256] [--layers 4] [--lr 3e-4]

A Llama of the given size (the shipped 512-id tokenizer's vocabulary, MLP 11/4 x hidden, heads of 64, seeded
random weights) trains --steps steps per variant in one process group on the built-in corpus (its records
tokenized with the shipped tokenizer, concatenated and cut into rows of --seq-len, the same rows in the same order
for every variant; --micro rows per rank), bf16, DeepSpeed's WarmupDecayLR (10 linear warmup steps, then linear
decay to 0 at steps + 1), no clipping. Reported: the loss at the first and last step, the last step's and the
mean of the last 20 steps' gap to the fp32 variant, and the dtypes of the live optimizer's master copy and states.
On CPU torch.compile is off (torchao compiles its step; inductor on CPU takes minutes). Writes nothing but /tmp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BF16 = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
VARIANTS = {"adamw fp32 master+states": ({}, False), "adamw bf16 master+states": (BF16, False),
            "torchao _AdamW bf16, stochastic rounding": (BF16, True)}
TAIL = 20


def rows(seq_len: int):
    import torch

    from harness.data.corpus import BUILTIN_CORPUS
    from harness.model.hf import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    ids = []
    for line in BUILTIN_CORPUS.read_text().splitlines():
        ids += tok(json.loads(line)["text"])["input_ids"] + [tok.eos_token_id]
    n = len(ids) // seq_len
    data = torch.tensor(ids[:n * seq_len]).view(n, seq_len)
    return data[torch.randperm(n, generator=torch.Generator().manual_seed(0))]


def model(args):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.AutoConfig.for_model(model_type="llama", vocab_size=512, hidden_size=args.hidden,
                                            intermediate_size=args.hidden * 11 // 4, num_hidden_layers=args.layers,
                                            num_attention_heads=max(1, args.hidden // 64), tie_word_embeddings=False)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def ds_config(args, flags: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": args.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": 2}, "bf16": {"enabled": True, **flags},
            "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.0}},
            "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                                              "warmup_num_steps": 10, "warmup_type": "linear",
                                                              "total_num_steps": args.steps + 1}},
            "zero_allow_untested_optimizer": True}


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as tdist

    deepspeed.init_distributed()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    data, out = rows(args.seq_len), {}
    per_step = args.micro * world
    for name, (flags, stochastic) in VARIANTS.items():
        net = model(args)
        client = None
        if stochastic:
            from torchao.optim import _AdamW

            client = _AdamW(net.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                            bf16_stochastic_round=True)
        engine, *_ = deepspeed.initialize(model=net, optimizer=client, config=ds_config(args, flags),
                                          model_parameters=None if client else net.parameters())
        losses = []
        for step in range(args.steps):
            start = (step * per_step) % (len(data) - per_step) + rank * args.micro
            ids = data[start:start + args.micro]
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().float().clone()
            tdist.all_reduce(mean)
            losses.append(float(mean) / world)
        inner = engine.optimizer.optimizer
        states = sorted({f"{k}:{v.dtype}" for s in inner.state.values() for k, v in s.items()
                         if torch.is_tensor(v) and v.numel() > 1})
        master = sorted({str(p.dtype) for g in inner.param_groups for p in g["params"]})
        out[name] = {"losses": losses, "states": states, "master": master}
        engine.destroy()
    if rank == 0:
        Path(args.worker).write_text(json.dumps(out))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--ranks", 2), ("--steps", 200), ("--hidden", 256), ("--layers", 4), ("--seq-len", 128),
                          ("--micro", 4)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from harness.dist import exit_now, free_port

    if args.worker:  # a rank: end without interpreter finalization (harness.dist.exit_now)
        worker(args)
        exit_now(0)

    with tempfile.TemporaryDirectory(prefix="stochastic_rounding_") as tmp:
        result = Path(tmp) / "losses.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", PYTHONPATH=str(ROOT),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        cmd = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(free_port()), "--num_gpus",
               str(args.ranks), __file__, "--worker", str(result)]
        cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                if k not in ("worker", "local_rank", "ranks")]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stderr[-3000:]}")
        out = json.loads(result.read_text())
    base = out[next(iter(out))]["losses"]
    print(f"Llama hidden {args.hidden} x {args.layers} layers, ZeRO-2 on {args.ranks} CPU ranks, bf16, seq "
          f"{args.seq_len}, micro {args.micro}, WarmupDecayLR from {args.lr}, {args.steps} steps")
    print(f"{'variant':<42}{'loss 1':>8}{'loss N':>8}{'gap N':>9}{'gap last 20':>13}  master / states")
    for name, r in out.items():
        loss = r["losses"]
        gap = (loss[-1] - base[-1]) / base[-1]
        tail = sum(a - b for a, b in zip(loss[-TAIL:], base[-TAIL:])) / sum(base[-TAIL:])
        print(f"{name:<42}{loss[0]:>8.3f}{loss[-1]:>8.3f}{gap:>+9.2%}{tail:>+13.2%}  {r['master']} / {r['states']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
