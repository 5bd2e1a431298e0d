"""Online RL (train.objective grpo): the prompt set, the rollouts (generated, scored, recorded, replayed), the
advantages and the GRPO family's losses; generation/ and rewards/ hold the generators (HF generate on the live
weights, ZeRO-3 gathered whole or in layer groups; a colocated vLLM) and the reward entries (functions with TRL's
signature, an HTTP verifier, reward models, built-ins, the code sandbox). The step that runs them on the policy's
engine, with the reference, is harness/train/grpo.py.

May import: config/, planner/, data/, model/, checkpoint/, profiling/ and the ground floor."""
