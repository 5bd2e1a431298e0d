"""Online RL (train.objective grpo): the prompt set, the rollouts (generated, scored, recorded, replayed), the
advantages and the GRPO family's losses; generation/ and rewards/ hold the generators and the reward entries. The
step that runs them on the policy's engine, with the reference, is harness/train/grpo.py.

May import: config/, planner/, data/, model/, checkpoint/, profiling/ and the ground floor."""
