"""`harness calibrate [--out FILE]`: measure this machine (GEMMs at the model's shapes, collectives on the real
backend, host copies, CPU Adam, NVMe) into a hardware profile that `harness plan --hardware FILE`, runs and
`--recipe auto` use. Not pure: it starts processes and touches the device; the measuring lives in
harness/profiling/calibrate.py."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="profile to write (default ~/.cache/dsharness/hardware.json, which runs and "
                                      "--recipe auto read)")
    parser.add_argument("--model", default="tiny-llama", help="model whose GEMM shapes to time (preset, known "
                                                              "name or config.json; default tiny-llama)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per forward (default 1)")
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--ranks", type=int, help="processes for the collectives (default: the GPUs here; 2 on CPU)")
    parser.add_argument("--nvme-path", help="folder on the NVMe drive to time async_io in (default: the temp dir)")
    parser.add_argument("--name", default="calibrated", help="profile name (default calibrated)")


def run(args: argparse.Namespace) -> int:
    from harness.commands.plan import resolve_model
    from harness.planner import hardware

    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch), ("--ranks", args.ranks)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    if args.nvme_path and not Path(args.nvme_path).is_dir():
        raise UsageError(f"--nvme-path {args.nvme_path}: not a directory")
    out = Path(args.out) if args.out else hardware.calibrated_path()
    cfg = resolve_model(args.model)
    from harness.profiling.calibrate import build_profile

    profile = build_profile(cfg, seq_len=args.seq_len, micro_batch=args.micro_batch, precision=args.precision,
                            ranks=args.ranks, nvme_path=args.nvme_path, name=args.name)
    hardware.check(profile, str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2) + "\n")
    tmp.replace(out)
    print(f"wrote {out}: use it with `harness plan --hardware {out}`; runs and --recipe auto read "
          f"{hardware.calibrated_path()} (or ${hardware.HARDWARE_ENV})")
    return 0
