"""`harness doctor [--recipe NAME] [--output-dir DIR] [--hostfile FILE]`: what to check on a machine before a
long job. Versions (torch, CUDA, NCCL, DeepSpeed), visible GPUs, which DeepSpeed ops can be loaded here (as
ds_report decides: op builders' is_compatible), libaio, /dev/shm, writable paths with free space, the hostfile.

Exit 1 when the named recipe cannot run here (the same checks `harness/run.py` makes before any rank trains,
each with what to install or change); 0 otherwise. Secrets are never printed: only whether a token is set.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from pathlib import Path

from harness.errors import ConfigError

DEFAULT_HOSTFILE = "/job/hostfile"  # where DeepSpeed's launcher looks when --hostfile is not given
HOST_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")  # deepspeed/launcher/runner.py _parse_hostfile's pattern
SHM_MIN_BYTES = 512 * 2**20  # ds_report warns below this (NCCL in containers needs --shm-size)
TOKEN_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY")
WIDTH = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--recipe", help="check that this recipe can run here: exit 1 (with what to install) if not; "
                                         "resolved for WORLD_SIZE if set, else one rank per visible GPU")
    parser.add_argument("--output-dir", help="run folder to check (default: the recipe's train.output_dir)")
    parser.add_argument("--hostfile", help=f"DeepSpeed hostfile to check (default: {DEFAULT_HOSTFILE} if present)")


def line(name: str, value: str) -> None:
    print(f"{name} {'.' * max(2, WIDTH - len(name))} {value}")


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.1f} GiB"


def versions() -> None:
    import deepspeed
    import torch
    import transformers

    line("torch", torch.__version__)
    line("CUDA (torch built with)", torch.version.cuda or "none (CPU build)")
    nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else "n/a (no CUDA device)"
    line("NCCL", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl))
    line("deepspeed", deepspeed.__version__)
    line("transformers", transformers.__version__)


def gpus() -> None:
    import torch
    from deepspeed.accelerator import get_accelerator

    line("accelerator", get_accelerator().device_name())
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    line("visible GPUs", str(count) + (f" (CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']})"
                                       if "CUDA_VISIBLE_DEVICES" in os.environ else ""))
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        line(f"  cuda:{i}", f"{props.name}, {gib(props.total_memory)}")


def ops_table() -> None:
    """One line per op, like ds_report: pre-built, compatible, JIT-built in the cache, and why not usable."""
    from torch.utils.cpp_extension import is_ninja_available

    from harness import ops

    line("ninja", "yes" if is_ninja_available() else "NO (pip install ninja)")
    line("C++ compiler", ops.compiler() or "NO (apt-get install build-essential)")
    for name in ops._builders():
        if name == "deepspeed_not_implemented":
            continue
        problem = ops.op_problem(name)
        state = "pre-built" if ops.is_prebuilt(name) else "built (cache)" if ops.is_cached(name) else "JIT on first use"
        line(f"op {name}", f"ok, {state}" if problem is None else f"NO: {problem[0]} -> {problem[1]}")
    aio = ops.op_problem("async_io")
    line("libaio (NVMe offload)", "NO (apt-get install libaio-dev)" if aio and aio[1] == ops.INSTALL_LIBAIO else "yes")


def shm() -> None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        line("/dev/shm", "missing")
        return
    size = st.f_frsize * st.f_blocks
    warn = " (small: NCCL in a container needs --shm-size=1g or more)" if size < SHM_MIN_BYTES else ""
    line("/dev/shm", f"{gib(size)}, {gib(st.f_frsize * st.f_bavail)} free{warn}")


def paths(folders: dict[str, Path]) -> None:
    from harness.train.checks import existing, unwritable

    for label, folder in folders.items():
        why = unwritable(folder)
        free = shutil.disk_usage(existing(folder)).free if why is None else None
        line(label, f"{folder}: " + (f"writable, {gib(free)} free" if why is None else f"NOT writable: {why}"))


def parse_hostfile(text: str) -> tuple[dict[str, int], list[str]]:
    """({host: slots}, problems) of a DeepSpeed hostfile: `host slots=N` lines, # comments, blank lines."""
    hosts: dict[str, int] = {}
    problems = []
    for num, raw in enumerate(text.splitlines(), 1):
        text_line = raw.split("#", 1)[0].strip()
        if not text_line:
            continue
        match = HOST_LINE.search(text_line)
        if not match:
            problems.append(f"line {num}: {text_line!r} is not 'HOST slots=N'")
        elif match.group(1) in hosts:
            problems.append(f"line {num}: host {match.group(1)} listed twice (the launcher refuses duplicates)")
        elif int(match.group(2)) < 1:
            problems.append(f"line {num}: {match.group(1)} has slots={match.group(2)}; needs at least 1")
        else:
            hosts[match.group(1)] = int(match.group(2))
    if not hosts and not problems:
        problems.append("no hosts listed")
    return hosts, problems


def hostfile(path: str | None) -> list[str]:
    if path is None and not Path(DEFAULT_HOSTFILE).is_file():
        line("hostfile", f"none (single node; {DEFAULT_HOSTFILE} absent)")
        return []
    path = path or DEFAULT_HOSTFILE
    try:
        hosts, problems = parse_hostfile(Path(path).read_text())
    except OSError as e:
        problems, hosts = [f"cannot read ({e.strerror})"], {}
    summary = f"{len(hosts)} hosts, {sum(hosts.values())} slots" if hosts else "unusable"
    line("hostfile", f"{path}: {summary}")
    for p in problems:
        line("", f"{path}: {p}")
    return [f"hostfile {path}: {p}" for p in problems]


SIGNAL_LINE = re.compile(r"^#SBATCH\s+--signal[= ](\S+)", re.M)
GPUS_PER_NODE_VARS = ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE")


def slurm_allocation(world: int) -> list[str]:
    """Inside a Slurm allocation: its nodes, tasks and GPUs per node against the recipe's world, the early
    signal its batch script asks for, and whether scontrol answers. Outside one: says so (not a problem)."""
    from harness.dist import slurm_job_id

    job = slurm_job_id()
    if job is None:
        line("slurm", "not in a Slurm allocation (SLURM_JOB_ID unset): nothing to check")
        return []
    env = os.environ
    nodes, per_node = allocation_shape()
    tasks = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "?")
    line("slurm job", f"{job}: {nodes} node(s), {tasks} task(s) per node, "
                      f"{per_node or 'no'} GPU(s) per node, restart {env.get('SLURM_RESTART_COUNT', '0')}")
    problems = []
    if per_node and nodes * per_node != world:
        problems.append(f"the allocation holds {nodes} node(s) x {per_node} GPU(s) = {nodes * per_node} ranks, "
                        f"the recipe was checked for world size {world}; fix: harness slurm --nodes N "
                        "--gpus-per-node G with N x G the world you mean")
    if tasks not in ("1", "?", str(per_node)):
        problems.append(f"{tasks} tasks per node: harness launch wants one per node (srun --ntasks-per-node=1), "
                        "ranks started by srun one per GPU")
    problems += _slurm_controller(job)
    return [f"slurm: {p}" for p in problems]


def _slurm_controller(job: str) -> list[str]:
    import subprocess

    if shutil.which("scontrol") is None:
        line("scontrol", "NOT on PATH")
        return ["scontrol is not on PATH: the batch script needs it (hostnames, requeue)"]
    done = subprocess.run(["scontrol", "write", "batch_script", job, "-"], capture_output=True, text=True,
                          timeout=30)
    if done.returncode != 0:
        line("scontrol", f"NO answer: {done.stderr.strip()[:120]}")
        return [f"scontrol cannot reach the controller ({done.stderr.strip()[:120]})"]
    signal = SIGNAL_LINE.search(done.stdout)
    line("scontrol", "answers")
    line("early signal", f"--signal={signal.group(1)}" if signal else "NONE")
    if signal is None:
        return ["the batch script asks for no early signal: at the time limit the ranks are killed without a "
                "checkpoint; fix: #SBATCH --signal=B:USR1@120 and --requeue (harness slurm writes both)"]
    return []


def recipe_problems(name: str, output_dir: str | None, launch) -> tuple[object, str | None]:
    """(the run spec or None, the problems text): the checks harness/run.py makes before any rank trains, for a
    launch of `launch` (harness.dist.Launch)."""
    from harness.train import session

    args = argparse.Namespace(recipe=name, ds_config=None, output_dir=output_dir, resume=None, overwrite=True,
                              overrides=[])
    try:
        return session.prepare(args, launch), None
    except ConfigError as e:
        spec = None
        try:
            spec = session.resolve_spec(args, launch)
        except ConfigError:
            pass
        return spec, str(e)


def launch_here():
    """A launch's own (WORLD_SIZE set) if this runs under one, else one rank per GPU seen here (at least 1),
    all on this node."""
    import torch

    from harness.dist import Launch, launched

    found = launched()
    if found is not None:
        return found
    ranks = max(1, torch.cuda.device_count() if torch.cuda.is_available() else 1)
    nodes, per_node = allocation_shape()
    if per_node:  # a Slurm allocation: its nodes x GPUs per node
        return Launch(world_size=nodes * per_node, local_size=per_node)
    return Launch(world_size=ranks, local_size=ranks)


def allocation_shape() -> tuple[int, int | None]:
    """(nodes, GPUs per node) of the Slurm allocation this runs in; GPUs None when Slurm gave none or none is."""
    env = os.environ
    if "SLURM_JOB_ID" not in env:
        return 1, None
    nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    gpus = next((env[v].split(":")[-1] for v in GPUS_PER_NODE_VARS if env.get(v)), "")
    return nodes, int(gpus) if gpus.isdigit() and int(gpus) > 0 else None


def run(args: argparse.Namespace) -> int:
    launch = launch_here()
    world = launch.world_size
    versions()
    gpus()
    ops_table()
    shm()
    set_tokens = [v for v in TOKEN_VARS if os.environ.get(v)]
    line("tokens in environment", ", ".join(f"{v} set (value not shown)" for v in set_tokens) or "none")
    spec, problems = recipe_problems(args.recipe, args.output_dir, launch) if args.recipe else (None, None)
    folders = {"output dir": Path(args.output_dir or (spec.recipe["train"]["output_dir"] if spec else "runs"))}
    zo = spec.ds_config.get("zero_optimization", {}) if spec else {}
    nvme = {(zo.get(b) or {}).get("nvme_path") for b in ("offload_param", "offload_optimizer")} - {None}
    folders.update({"nvme path": Path(p) for p in sorted(nvme)})
    paths(folders)
    host_problems = hostfile(args.hostfile) + slurm_allocation(world)
    if problems:
        print(f"\nrecipe {args.recipe} cannot run here (world size {world}):\n{problems}")
        return 1
    if host_problems:
        print("\nthe hostfile or the Slurm allocation would stop a multi-node launch:\n  "
              + "\n  ".join(host_problems))
        return 1
    if args.recipe:
        print(f"\nrecipe {args.recipe}: can run here (world size {world})")
    return 0
