"""Train: one job on one rank. The session (arguments, recipe, checks before ranks talk), the job (run folder, data,
model, engine), the loop, metrics, preemption, and what `harness launch --max-restarts` needs to start a failed run
again in its own folder (restarts).

May import: the ground floor, config/, planner/, data/, model/, checkpoint/, profiling/, trackers/, rl/, distill/."""
