"""Mixture-of-Experts models: the DeepSpeed blocks a MoE run adds (expert_parallel, zero_optimization.leaf_module),
the router's balancing loss, tokens per expert and the AutoEP/transformers compatibility shim, all from the family
table in config/moe_families.py (leaves, AutoEP preset, expert modules, aux loss). Part of the model room."""
