"""Model: build the model a rank trains (hub id, folder, preset; on meta and loaded by share in load/), the parallel
layouts DeepSpeed does not make of an HF model itself (parallel/: pipeline stages, tensor-parallel layers), and LoRA.

May import: the ground floor, config/, planner/, data/."""
