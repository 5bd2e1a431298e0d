"""Mixture-of-Experts models: the family table (leaves, AutoEP preset, expert modules, aux loss), the DeepSpeed
blocks a MoE run adds (expert_parallel, zero_optimization.leaf_module), the router's balancing loss and the
AutoEP/transformers compatibility shim. Part of the model room."""
