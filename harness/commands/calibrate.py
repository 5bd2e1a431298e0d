"""`harness calibrate [--out FILE]`: measure this machine (GEMMs at the model's shapes, collectives on the real
backend, host copies, CPU Adam, NVMe) into a hardware profile that `harness plan --hardware FILE`, runs and
`--recipe auto` use. Not pure: it starts processes and touches the device; the measuring lives in
harness/calibration/."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.config.defaults import PRECISION_BYTES, recipe_default
from harness.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", help="profile to write (default ~/.cache/dsharness/hardware.json, which runs and "
                                      "--recipe auto read)")
    parser.add_argument("--model", default="tiny-llama", help="model whose GEMM shapes to time (preset, known "
                                                              "name or config.json; default tiny-llama)")
    parser.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per forward (default 1)")
    parser.add_argument("--precision", choices=tuple(PRECISION_BYTES), default=recipe_default("precision"))
    parser.add_argument("--ranks", type=int, help="processes for the collectives (default: the GPUs here; 2 on CPU)")
    parser.add_argument("--nvme-path", help="folder on the NVMe drive to time async_io in (default: the temp dir)")
    parser.add_argument("--name", default="calibrated", help="profile name (default calibrated)")
    link = parser.add_argument_group("the link between nodes (run on every node at once, one process per node; "
                                     "node 0 writes --out: the base profile with the measured inter-node figures)")
    link.add_argument("--link", action="store_true", help="measure the network between nodes instead of this node")
    link.add_argument("--node-rank", type=int, default=0, help="this node, 0-based (0: the --master-addr node)")
    link.add_argument("--nnodes", type=int, default=2, help="nodes taking part (default 2)")
    link.add_argument("--master-addr", help="node 0's address, reachable from every node")
    link.add_argument("--master-port", type=int, default=29500, help="a free TCP port on node 0 (default 29500)")
    link.add_argument("--base", help="the node profile to add the link to (default: the --out file if it exists, "
                                     "else this node's calibrated profile)")


def run(args: argparse.Namespace) -> int:
    from harness.commands.plan import resolve_model
    from harness.planner import hardware

    for flag, value in (("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch), ("--ranks", args.ranks)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    if args.nvme_path and not Path(args.nvme_path).is_dir():
        raise UsageError(f"--nvme-path {args.nvme_path}: not a directory")
    out = Path(args.out) if args.out else hardware.calibrated_path()
    if args.link:
        return run_link(args, out)
    cfg = resolve_model(args.model)
    from harness.calibration.node import build_profile

    profile = build_profile(cfg, seq_len=args.seq_len, micro_batch=args.micro_batch, precision=args.precision,
                            ranks=args.ranks, nvme_path=args.nvme_path, name=args.name)
    write(profile, out)
    print(f"wrote {out}: use it with `harness plan --hardware {out}`; runs and --recipe auto read "
          f"{hardware.calibrated_path()} (or ${hardware.HARDWARE_ENV})")
    return 0


def write(profile: dict, out: Path) -> None:
    from harness.planner import hardware

    hardware.check(profile, str(out))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(profile, indent=2) + "\n")
    tmp.replace(out)


def run_link(args: argparse.Namespace, out: Path) -> int:
    import time

    from harness.planner import hardware
    from harness.calibration.link import measure as measure_link, merge as merge_link

    if not args.master_addr:
        raise UsageError("--link needs --master-addr: node 0's address, reachable from every node")
    if args.nnodes < 2 or not 0 <= args.node_rank < args.nnodes:
        raise UsageError(f"--nnodes {args.nnodes} --node-rank {args.node_rank}: need 2 or more nodes and "
                         "0 <= node rank < nodes")
    base_path = Path(args.base) if args.base else out if out.exists() else hardware.calibrated_path()
    if args.node_rank == 0 and not base_path.exists():
        raise UsageError(f"--link adds the link to a node profile, and {base_path} does not exist: run "
                         "`harness calibrate` on this node first (or give --base FILE)")
    link = measure_link(args.node_rank, args.nnodes, args.master_addr, args.master_port)
    if args.node_rank != 0:
        print(f"node {args.node_rank}: link measured; node 0 writes the profile")
        return 0
    profile = merge_link(json.loads(base_path.read_text()), link, time.strftime("%Y-%m-%d %H:%M"))
    write(profile, out)
    for op, by_n in link["bus_gbps"].items():
        print(f"  {link['backend']} {op} across {link['nodes']} nodes: "
              + ", ".join(f"{v * 1e3:.1f} MB/s" for v in by_n.values()))
    print(f"wrote {out}: inter_node_gbps {profile['inter_node_gbps']:.4g}, inter_latency_us "
          f"{profile['inter_latency_us']:.0f} (base {base_path})")
    return 0
