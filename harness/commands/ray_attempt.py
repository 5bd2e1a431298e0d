"""One attempt of `harness ray` (harness/commands/ray.py): the nodes gathered in a placement group, one agent per
node started, the nodes' launches watched to their end, or (an attempt on fewer than --nodes nodes) to the run's
next complete checkpoint once the missing nodes are back: the grow-back. Ray is passed in (imported by the driver
only)."""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from harness.log import say
from harness.train.preempt import EXIT_PREEMPTED
from harness.train.restarts import newest_complete

STOPPED = -1  # a node's launch the driver killed: it outlived the others' end by train.collective_timeout + margin
POLL_S = 0.5
START_TIMEOUT_S = 120.0  # for the agents of a ready placement group to answer
GROW_CHECK_S = 2.0  # how often an attempt on fewer than --nodes nodes asks Ray for its nodes
CKPT_POLL_S = 0.05  # how often, once they are back, it looks for the run's next complete checkpoint


@dataclass
class Group:
    pg: object  # ray.util.placement_group.PlacementGroup
    nodes: int


@dataclass
class Outcome:
    codes: dict[int, int] = field(default_factory=dict)  # node index -> its launch's exit code (STOPPED)
    lost: dict[int, str] = field(default_factory=dict)  # node index -> why Ray says its agent is gone
    where: list[dict] = field(default_factory=list)  # each node's Agent.where()
    grown: str | None = None  # the checkpoint the attempt was stopped after for a grow-back to --nodes nodes

    @property
    def code(self) -> int:
        """The attempt's code: bad input or a numeric fault first, then any failure (1 for a lost node), then 75."""
        codes = list(self.codes.values())
        for wanted in (2, 3):
            if wanted in codes:
                return wanted
        failed = [c for c in codes if c not in (0, EXIT_PREEMPTED, STOPPED)]
        if failed or self.lost or STOPPED in codes:
            return failed[0] if failed else 1
        return EXIT_PREEMPTED if EXIT_PREEMPTED in codes else 0

    def name(self, i: int) -> str:
        w = self.where[i] if i < len(self.where) else {}
        return f"node {i} ({w.get('addr', '?')}, {w.get('host', '?')})"

    def codes_by_node(self) -> dict[str, int | None]:
        return {self.name(i): self.codes.get(i) for i in range(len(self.where))}

    def lost_names(self) -> list[str]:
        return [self.name(i) for i in sorted(self.lost)]

    def describe(self) -> str:
        if self.grown:
            return f"stopped after {self.grown} to grow back to every node"
        parts = [f"{self.name(i)} lost ({why})" for i, why in sorted(self.lost.items())]
        parts += [f"{self.name(i)} {'stopped after the others ended' if c == STOPPED else f'exited {c}'}"
                  for i, c in sorted(self.codes.items())]
        return ", ".join(parts)


def bundle(plan) -> dict:
    return {"CPU": 1} if plan.cpu else {"CPU": 1, "GPU": plan.per_node}


def nodes_with(ray, need: dict) -> int:
    """Alive nodes that have a bundle's resources (in total; what runs there now is not counted)."""
    return sum(1 for n in ray.nodes() if n.get("Alive") and all(n["Resources"].get(k, 0) >= v for k, v in need.items()))


def _ready(ray, pg, timeout_s: float, pending: list[int]) -> bool:
    deadline, ready = time.monotonic() + timeout_s, pg.ready()  # one check task, waited on in slices
    while not pending and time.monotonic() < deadline:
        if ray.wait([ready], timeout=min(POLL_S, max(0.0, deadline - time.monotonic())))[0]:
            return True
    return False


class NodesMissing(Exception):
    """Too few nodes for the run after --node-wait: the job ends with exit 1 and this message."""


def gather(ray, plan, pending: list[int]) -> Group | None:
    """A placement group over plan.nodes nodes, or (--min-nodes) over as many as there are after --node-wait;
    None when a signal came meanwhile; NodesMissing when fewer than --min-nodes are up."""
    from ray.util.placement_group import placement_group, remove_placement_group

    need = bundle(plan)
    say("ray", f"waiting up to {plan.node_wait_s:g} s for {plan.nodes} nodes with {need} each "
               f"({nodes_with(ray, need)} up now)")
    pg = placement_group([need] * plan.nodes, strategy="STRICT_SPREAD")
    if _ready(ray, pg, plan.node_wait_s, pending):
        return Group(pg, plan.nodes)
    remove_placement_group(pg)
    if pending:
        return None
    have = min(nodes_with(ray, need), plan.nodes)
    if have < plan.min_nodes:
        raise NodesMissing(f"harness ray: {have} node(s) with {need} after --node-wait {plan.node_wait_s:g} s, "
                           f"{plan.min_nodes} needed (--min-nodes {plan.min_nodes}, --nodes {plan.nodes})")
    say("ray", f"{have} of {plan.nodes} nodes after {plan.node_wait_s:g} s: continuing on {have} "
               f"(--min-nodes {plan.min_nodes}), world {have * plan.per_node}")
    pg = placement_group([need] * have, strategy="STRICT_SPREAD")
    if _ready(ray, pg, plan.node_wait_s, pending):
        return Group(pg, have)
    remove_placement_group(pg)
    if pending:
        return None
    raise NodesMissing(f"harness ray: the {have} node(s) seen could not be placed within {plan.node_wait_s:g} s")


def launch_argv(i: int, where: list[dict], plan, script_args: list[str]) -> tuple[list[str], str]:
    """Node i's `harness launch` arguments and its hostfile (the same on every node; --no_ssh: labels only). GPU
    ranks: the GPUs Ray gave each node's agent, by --include (DeepSpeed's launcher sets CUDA_VISIBLE_DEVICES)."""
    lines, include = [], []
    for n, w in enumerate(where):
        ids = w["gpu_ids"]
        lines.append(f"node{n} slots={max(ids) + 1 if ids else plan.per_node}")
        include.append(f"node{n}:{','.join(map(str, ids))}")
    flags = [] if plan.cpu else ["--include", "@".join(include)]
    argv = ["launch", "--hostfile", "{hostfile}", "--no_ssh", "--node_rank", str(i), "--master_addr",
            where[0]["addr"], "--master_port", str(where[0]["port"]), *flags, plan.script, *script_args]
    return argv, "\n".join(lines) + "\n"


def run_attempt(ray, plan, group: Group, script_args: list[str], pending: list[int]) -> Outcome:
    from harness.commands.ray_agent import Agent
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    remote = ray.remote(num_cpus=1, num_gpus=0 if plan.cpu else plan.per_node, max_restarts=0)(Agent)
    agents = [remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group.pg, i)).remote()
              for i in range(group.nodes)]
    outcome = Outcome()
    i = 0
    try:
        for i, agent in enumerate(agents):
            outcome.where.append(ray.get(agent.where.remote(), timeout=START_TIMEOUT_S))
        for i, agent in enumerate(agents):
            argv, hostfile = launch_argv(i, outcome.where, plan, script_args)
            ray.get(agent.start.remote(argv, hostfile, os.getcwd()), timeout=START_TIMEOUT_S)
        say("ray", f"{group.nodes} node(s) x {plan.per_node} ranks: " + ", ".join(
            f"{outcome.name(i)}" for i in range(group.nodes)) + f"; master {outcome.where[0]['addr']}:"
            f"{outcome.where[0]['port']}")
        grow = GrowBack(ray, plan) if group.nodes < plan.nodes else None
        watch(ray, agents, outcome, plan.stop_after_s, pending, grow)
    except ray.exceptions.RayError as e:  # agent i's node lost before every launch started
        outcome.lost[i] = str(e).strip().splitlines()[0][:200]
    finally:
        for agent in agents:
            with contextlib.suppress(Exception):
                ray.get(agent.stop.remote(), timeout=60)
            ray.kill(agent)
        remove_placement_group(group.pg)
    return outcome


def _step(tag: str | None) -> int:
    return int(tag.removeprefix("global_step")) if tag else 0


class GrowBack:
    """An attempt on fewer than --nodes nodes: due() is the checkpoint to stop after (then the driver relaunches on
    every node with --resume latest), once the missing nodes are back (alive, with a bundle's resources) and the
    run has completed a checkpoint newer than the one that stood when they came back; None until then. The run's
    last step's checkpoint is never one: the run ends there on the nodes it has."""

    def __init__(self, ray, plan):
        self.ray, self.plan = ray, plan
        self.since: str | None = None  # the newest complete checkpoint when the nodes were back ("" for none)
        self.next_check = 0.0

    def due(self, wait_s: float = 0.0) -> str | None:
        """Ask Ray for its nodes (every GROW_CHECK_S); once they are back, watch the checkpoints for up to wait_s
        (a step can take less than the driver's poll: the stop comes within CKPT_POLL_S of the save)."""
        deadline = time.monotonic() + wait_s
        if self.since is None and time.monotonic() >= self.next_check:
            self.next_check = time.monotonic() + GROW_CHECK_S
            if nodes_with(self.ray, bundle(self.plan)) >= self.plan.nodes:
                self.since = newest_complete(self.plan.run_dir) or ""
                say("ray", f"{self.plan.nodes} nodes are up again: growing back at the run's next checkpoint "
                           f"(after {self.since or 'none yet'})")
        while True:
            tag = newest_complete(self.plan.run_dir) if self.since is not None else None
            if tag and _step(self.since) < _step(tag) < self.plan.steps:
                return tag
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(CKPT_POLL_S, max(0.0, deadline - time.monotonic())))


def watch(ray, agents: list, outcome: Outcome, stop_after_s: float, pending: list[int],
          grow: GrowBack | None = None) -> None:
    """Poll every node's launch until each has ended or is lost; forward signals as they come. Once one node
    failed (or was lost), the others get stop_after_s (their collective_timeout and a margin) before being killed.
    With `grow` (fewer nodes than --nodes), return once it names a checkpoint: the caller stops every node."""
    forwarded, failed_at = 0, None
    live = set(range(len(agents)))
    while live:
        for signum in pending[forwarded:]:
            for i in live:
                agents[i].signal.remote(signum)
        forwarded = len(pending)
        refs = {i: agents[i].poll.remote() for i in live}
        done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=5.0)
        for i, ref in refs.items():
            if ref not in done:
                continue  # no answer: Ray declares the node dead after its health checks
            try:
                code = ray.get(ref)
            except ray.exceptions.RayError as e:
                outcome.lost[i] = str(e).strip().splitlines()[0][:200]
                live.discard(i)
                continue
            if code is not None:
                outcome.codes[i] = code
                live.discard(i)
        if failed_at is None and (outcome.lost or any(c not in (0, EXIT_PREEMPTED) for c in outcome.codes.values())):
            failed_at = time.monotonic()
        if failed_at is not None and live and time.monotonic() - failed_at > stop_after_s:
            for i in sorted(live):
                say("ray", f"{outcome.name(i)} still runs {stop_after_s:g} s after the first failure: stopping it")
                outcome.codes[i] = STOPPED
            return
        if not (grow and live and failed_at is None and not pending):
            time.sleep(POLL_S)
        elif tag := grow.due(POLL_S):
            say("ray", f"{tag} complete: stopping the attempt on {len(agents)} node(s) to grow back")
            outcome.grown = tag
            return
