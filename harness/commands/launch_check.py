"""`harness launch --dry-run [deepspeed options] harness/run.py ...`: every check harness/run.py makes before its ranks
start, for the world the launch would start, in this one process; nothing is started and nothing is written.

The world is DeepSpeed's: its runner's resource pool (the hostfile, or this machine's devices), --include/--exclude,
then --num_nodes/--num_gpus (deepspeed.launcher.runner's own functions). harness/run.py's checks then run as rank 0
of that world does (harness/train/session.py `prepare`: the recipe and overrides, the DeepSpeed dict resolved and
schema-checked, the model and data found, the rules, this machine's ops and paths), so a command for 8 GPUs on 4
nodes can be checked on a laptop. Exit 0 with the resolved layout and batch, or 2 with every problem.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.errors import RunComplete, UsageError
from harness.log import say


def world_of(parsed) -> tuple[int, int, int]:
    """(ranks in all, ranks on the first node, nodes) that DeepSpeed's runner would start for its parsed arguments."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.launcher.runner import apply_num_nodes_and_gpus, fetch_hostfile, parse_inclusion_exclusion

    hosts = fetch_hostfile(parsed.hostfile) if os.path.isfile(parsed.hostfile) else None  # None: it warns
    pool = hosts or {"localhost": get_accelerator().device_count()}
    if (parsed.num_nodes > 0 or parsed.num_gpus > 0) and (parsed.include or parsed.exclude):
        raise UsageError("harness launch: --num_nodes/--num_gpus with --include/--exclude (DeepSpeed refuses both)\n"
                         "    fix: choose the ranks one way")
    if parsed.num_nodes > len(pool):
        where = f"the hostfile {parsed.hostfile} names {len(pool)} host(s)" if hosts else \
            f"no hostfile ({parsed.hostfile}): this machine only"
        raise UsageError(f"harness launch --num_nodes {parsed.num_nodes}: {where}\n"
                         "    fix: list every node in a hostfile, --hostfile FILE (docs/multi-node.md)")
    active = apply_num_nodes_and_gpus(parse_inclusion_exclusion(pool, parsed.include, parsed.exclude),
                                      parsed.num_nodes, parsed.num_gpus)
    slots = [len(s) for s in active.values()]
    return sum(slots), slots[0], len(slots)


def main(command) -> int:
    """Check a launch (harness/commands/launch.py's Command: DeepSpeed's arguments, the script, harness/run.py's
    arguments) without starting it."""
    from deepspeed.launcher.runner import parse_args

    from harness.dist import Launch
    from harness.train import run_args, session

    parsed = parse_args(command.head + [command.script])  # split_command had DeepSpeed's parser accept them
    world, local, nodes = world_of(parsed)
    args = run_args.parse(command.script_args)
    try:
        spec = session.prepare(args, Launch(world_size=world, local_size=local))
    except RunComplete as e:  # as harness/run.py: a finished run resumed is done, not an error
        say("done", str(e))
        return 0
    batch = spec.run.batch
    say("check", f"{command.script} resolved for world {world} ({nodes} node(s), {local} on the first): recipe "
                 f"{spec.recipe_name} | objective {spec.recipe['train']['objective']} | zero {spec.zero_stage} | "
                 f"tp {spec.tp} pp {spec.pp} sp {spec.sp} dp {spec.dp} | {spec.run.precision}")
    say("check", f"{batch.micro_batch} micro x {batch.grad_accum} accum x {spec.dp} dp = {batch.global_batch} per "
                 f"step, seq_len {spec.run.sequence.seq_len}, {spec.recipe['train']['steps']} steps; model "
                 f"{spec.recipe['train']['model']}, dataset {spec.recipe['train']['dataset']}")
    for w in spec.warnings:
        say("warn", w.render())
    out = spec.output_dir or Path(spec.recipe["train"]["output_dir"]) / f"<date>_{spec.recipe_name}"
    say("check", f"every check before the ranks start passed; nothing started, nothing written (run folder: {out})")
    return 0
