"""Train: one job on one rank. The session (arguments, recipe, checks before ranks talk), the job (run folder, data,
model, engine), the loop, metrics and preemption.

May import: the ground floor, config/, planner/, data/, model/, checkpoint/, profiling/."""
