"""Online RL (train.objective grpo): the prompt set, the rollouts (generated, scored, recorded, replayed), the
advantages and the GRPO family's losses; generation/ and rewards/ hold the generators and the reward entries.

May import: config/, planner/, data/, model/, checkpoint/, profiling/ and the ground floor. harness/train/grpo.py runs
the step (it holds the policy's engine and the reference, train/reference*.py)."""
