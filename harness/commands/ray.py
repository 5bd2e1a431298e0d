"""`harness ray --address HOST:PORT --nodes N --gpus-per-node G [...] harness/run.py ...`: a run on a Ray cluster.

Runnable directly (anywhere the cluster's address is reachable) or as the entrypoint of `ray job submit`. Before
Ray is asked for anything, the recipe is resolved for N x G ranks with harness/run.py's own checks (bad input: exit
2 here, not on the nodes). Then, attempt after attempt (the driver is the requeue loop):
  - one placement group of N bundles spread over N nodes (STRICT_SPREAD), waited for up to --node-wait seconds;
  - one agent actor per bundle (harness/commands/ray_agent.py) running that node's `harness launch --no_ssh
    --node_rank i --master_addr <agent 0's address> --master_port <free there>` in a session of its own;
  - the driver polls the agents and ends the attempt by what the nodes' launches return:
      every node 0                      -> exit 0;
      SIGTERM/SIGUSR1/SIGINT to the driver (preemption, `ray job stop`) -> forwarded to every node's launch, every
                                           rank saves at one agreed step -> exit 75; the same command again
                                           resumes from `latest` (the first attempt runs with --resume auto);
      2 (bad input) or 3 (numeric fault) -> the job ends with that code, the rank's reason in its log;
      a node lost (its raylet, agent or launch gone) or another failure -> the other nodes' ranks end within
                                           train.collective_timeout (stopped if they outlive it by a margin), a
                                           line in RUN/restarts.jsonl names the node and the checkpoint step, and
                                           the next attempt waits for N nodes and resumes with --resume latest,
                                           up to --max-failures times;
  - with --min-nodes M < N, an attempt that finds only n (M <= n < N) nodes after --node-wait runs on those n:
    the resume loads the checkpoint through DeepSpeed's universal form (harness/train/session.py), the global
    batch kept. While it runs, the driver watches for the missing nodes to come back; once they have, it stops
    the attempt right after the run's next complete checkpoint and relaunches on N nodes with --resume latest
    (the grow-back: a line in RUN/restarts.jsonl, not counted against --max-failures).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError
from harness.log import say
from harness.train import restarts
from harness.train.preempt import EXIT_NUMERIC_FAULT, EXIT_PREEMPTED

EXIT_BAD_INPUT = 2
FORWARDED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
POLL_S = 0.5
STOP_MARGIN_S = 60.0  # past train.collective_timeout: a rank's check-in, its exit, the launcher's exit
START_TIMEOUT_S = 120.0  # for the agents of a ready placement group to answer
FIX = "    fix: e.g. harness ray --address HEAD:6379 --nodes 2 --gpus-per-node 8 harness/run.py --recipe zero3 " \
      "--output-dir /shared/runs/r1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=os.environ.get("RAY_ADDRESS"),
                        help="the Ray cluster's head, HOST:PORT (default: $RAY_ADDRESS, which `ray job submit` sets)")
    parser.add_argument("--nodes", type=_count, required=True, help="nodes, one agent and one harness launch each")
    parser.add_argument("--gpus-per-node", type=_count, required=True, help="GPUs, one rank each, per node")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks (no GPU asked of Ray; --gpus-per-node counts "
                                                           "ranks)")
    parser.add_argument("--min-nodes", type=_count, default=None, metavar="M",
                        help="continue on M..N nodes when N cannot be had after --node-wait, growing back to N at the "
                             "run's next checkpoint once they are up (default: N)")
    parser.add_argument("--max-failures", type=_whole, default=3, metavar="K",
                        help="relaunches after a lost node or a failed attempt (default 3)")
    parser.add_argument("--node-wait", type=float, default=300.0, metavar="S",
                        help="seconds to wait for the nodes of an attempt (default 300)")
    parser.add_argument("script", help="harness/run.py")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="harness/run.py's arguments")


def _count(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def _whole(text: str) -> int:
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 0")
    return int(text)


@dataclass
class Plan:
    address: str
    nodes: int
    min_nodes: int
    per_node: int
    cpu: bool
    node_wait_s: float
    max_failures: int
    script: str
    script_args: list[str]  # as given; a relaunch's are restarts.restart_args of these
    first_args: list[str]  # the first attempt's: --resume auto unless the command names --resume
    run_dir: Path
    stop_after_s: float  # train.collective_timeout + STOP_MARGIN_S
    steps: int  # train.steps: a shrunk attempt grows back at a checkpoint before the last step only


def check(args) -> Plan:
    """Everything that can be refused before Ray is asked: the command, the counts, the recipe for N x G ranks."""
    from harness.dist import Launch
    from harness.train import run_args, session

    if not args.address:
        raise UsageError("harness ray: no --address and no $RAY_ADDRESS: which Ray cluster?\n" + FIX)
    if Path(args.script).parts[-2:] != ("harness", "run.py"):
        raise UsageError(f"harness ray: {args.script} is not harness/run.py; a relaunch continues harness/run.py "
                         "from its latest checkpoint\n" + FIX)
    min_nodes = args.min_nodes or args.nodes
    if min_nodes > args.nodes:
        raise UsageError(f"harness ray --min-nodes {min_nodes} --nodes {args.nodes}: the run cannot need more nodes "
                         f"than it asks for\n    fix: --min-nodes between 1 and {args.nodes}")
    if not 0 < args.node_wait < float("inf"):
        raise UsageError(f"harness ray --node-wait {args.node_wait:g}: not a number of seconds > 0\n"
                         "    fix: e.g. --node-wait 300")
    parsed = run_args.parse(args.script_args)
    if not parsed.output_dir:
        raise UsageError("harness ray: harness/run.py needs --output-dir, the run folder on storage every node "
                         "shares: a relaunch (and the same command again) continues it\n" + FIX)
    first = list(args.script_args) + ([] if parsed.resume else ["--resume", "auto"])
    spec = session.resolve_spec(run_args.parse(first), Launch(world_size=args.nodes * args.gpus_per_node,
                                                              local_size=args.gpus_per_node))
    return Plan(args.address, args.nodes, min_nodes, args.gpus_per_node, args.cpu, args.node_wait, args.max_failures,
                str(Path(args.script).resolve()), list(args.script_args), first, Path(parsed.output_dir).resolve(),
                spec.recipe["train"]["collective_timeout"] * 60 + STOP_MARGIN_S, spec.recipe["train"]["steps"])


def import_ray():
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # never report usage (Ray's default is on)
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # the nodes' log lines as they are, not "[repeated 2x]"
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # "(Agent pid=N, ip=A)" before each line, without colour codes
    try:
        import ray
    except ImportError:
        raise UsageError("harness ray needs Ray, an optional extra\n    fix: pip install 'dsharness[ray]' "
                         "(ray 2.60, the same on every node)") from None
    return ray


def own_address(address: str) -> str | None:
    """The address this machine reaches the head from (Ray would otherwise look for it towards a public DNS
    address, which a cluster's private network may not route)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except OSError:
        return None


def connect(ray, address: str) -> None:
    try:
        ray.init(address=address, _node_ip_address=own_address(address), logging_level="WARNING")
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise UsageError(f"harness ray --address {address}: no Ray cluster answers there ({e})\n    fix: the head's "
                         "HOST:PORT as `ray start --head --port PORT` printed it; `ray status --address HOST:PORT` "
                         "checks it") from None


def run(args: argparse.Namespace) -> int:
    plan = check(args)
    ray = import_ray()
    connect(ray, plan.address)
    pending: list[int] = []
    saved = {sig: signal.signal(sig, lambda signum, frame: pending.append(signum)) for sig in FORWARDED}
    try:
        return requeue_loop(ray, plan, pending)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        ray.shutdown()


def requeue_loop(ray, plan: Plan, pending: list[int]) -> int:
    from harness.commands import ray_attempt

    script_args, failures, attempt = plan.first_args, 0, 0
    while True:
        try:
            group = ray_attempt.gather(ray, plan, pending)
        except ray_attempt.NodesMissing as e:
            say("ray", f"{e}: exit 1")
            return 1
        if group is None:  # a signal while waiting: nothing runs, the latest checkpoint stands
            say("ray", "signal while waiting for nodes: exit 75, the same command resumes from latest")
            return EXIT_PREEMPTED
        attempt += 1
        outcome = ray_attempt.run_attempt(ray, plan, group, script_args, pending)
        code = outcome.code
        if outcome.grown and not pending:
            script_args, tag = restarts.restart_args(plan.script_args, plan.run_dir)
            _record(plan, attempt, outcome, None, tag, script_args, grow_back=True)
            say("ray", f"attempt {attempt} on {group.nodes} node(s) stopped after {outcome.grown}: relaunch on "
                       f"{plan.nodes} nodes from {tag} (a grow-back, not a failure)")
            continue
        if pending or (code in (0, EXIT_BAD_INPUT, EXIT_NUMERIC_FAULT, EXIT_PREEMPTED) and not outcome.lost):
            say("ray", f"attempt {attempt} ended: {outcome.describe()}; exit {code}")
            return code
        failures += 1
        if failures > plan.max_failures:
            say("ray", f"attempt {attempt} failed ({outcome.describe()}); --max-failures {plan.max_failures} "
                       f"used up: exit {code}")
            return code
        script_args, tag = restarts.restart_args(plan.script_args, plan.run_dir)
        _record(plan, attempt, outcome, code, tag, script_args)
        say("ray", f"attempt {attempt} failed ({outcome.describe()}); relaunch {failures}/{plan.max_failures} "
                   f"{f'from {tag}' if tag else 'from the start'} once {plan.nodes} nodes are up")


def _record(plan: Plan, attempt: int, outcome, code: int | None, tag: str | None, script_args: list[str],
            grow_back: bool = False) -> None:
    """One line in RUN/restarts.jsonl: the attempt that ended, why, and the checkpoint the next one resumes."""
    record = {"attempt": attempt, "time": round(time.time(), 3), "code": code, "launcher": "harness ray",
              "exit_codes": outcome.codes_by_node(), "lost_nodes": outcome.lost_names(),
              "reason": outcome.describe(), "step": int(tag.removeprefix("global_step")) if tag else 0,
              "backoff_s": 0, "resume_from": tag, "script_args": script_args, "grow_back": grow_back}
    if plan.run_dir.is_dir():
        restarts.append(plan.run_dir, record)
