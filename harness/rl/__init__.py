"""RL: what online reinforcement learning adds beside train/: generators (completions from the policy's live weights
on every ZeRO stage, HF generate or a colocated vLLM), rewards (functions with TRL's signature, an HTTP verifier,
reward models, built-ins and the code sandbox) and rollouts.

May import: the ground floor, config/, planner/, data/, model/, checkpoint/, profiling/, trackers/."""
