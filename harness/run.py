"""Train a Hugging Face causal LM with DeepSpeed from a recipe.

    harness launch --num_gpus 2 harness/run.py --recipe zero2_offload   (`deepspeed`'s arguments; safe to signal)
    python harness/run.py --recipe ddp --set train.steps=20             (one process)

parse -> load recipe -> resolve + validate for this world size -> train -> teardown.
Exit codes: 0 done (also a resumed run already at train.steps: it says so and writes nothing); 2 bad input (one
clear message on rank 0, and on each other node's first rank, before any process group exists); 75 preempted
(SIGTERM/SIGUSR1: checkpoint saved at the step the ranks agreed on, `--resume latest` continues;
harness/train/preempt.py); 3 numeric fault (train.on_nonfinite: the step, the ranks and the batch's rows named,
nothing saved after it; harness/train/faults.py); 69 a served teacher stopped answering (an outage: retried by
`harness launch --max-restarts`, Kubernetes, Ray and the Slurm script; harness/distill/served.py); 1 anything else, e.g. a collective that outlived
train.collective_timeout.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # launched by path (deepspeed harness/run.py): make `harness` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.errors import ConfigError, RunComplete, UsageError, without_secrets  # noqa: E402


def main(argv: list[str] | None = None, launch=None) -> int:
    """`launch`: what the launcher said (harness.dist.launched), read here once when not given."""
    from harness.train import run_args, session
    from harness.dist import ONE_PROCESS, CollectiveTimeout, launched

    launch = launch or launched() or ONE_PROCESS
    rank = launch.rank
    # Each node's first rank speaks too: a problem of one machine (no libaio, a full disk) on a node other than
    # rank 0's must still be seen, as that node's ranks are the only ones that stop.
    node_first = launch.local_rank == 0
    try:
        spec = session.prepare(run_args.parse(argv), launch)
        from harness.train import job

        return job.main(spec)
    except (ConfigError, UsageError) as e:
        if rank == 0 or node_first:
            text = without_secrets(str(e))
            print(f"error: {text}" if rank == 0 else f"error (rank {rank}): {text}", file=sys.stderr)
        return 2
    except RunComplete as e:  # exit 0: a restart or a requeue after the last step ends as done
        if rank == 0:
            from harness.log import say

            say("done", str(e))
        return 0
    except CollectiveTimeout as e:  # every rank that timed out says so: the first line names the setting
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if rank == 0:
            print("interrupted: stopped cleanly (checkpoints written so far are intact)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    from harness.startup import quick_start

    quick_start()  # before DeepSpeed is imported
    from harness.dist import ONE_PROCESS, exit_now, launched
    from harness.train.preempt import report_exit

    launch = launched() or ONE_PROCESS
    code = 1  # an exception escaping main(): Python prints it and exits 1
    try:
        code = main(launch=launch)
    finally:
        report_exit(code, launch)
    exit_now(code)
