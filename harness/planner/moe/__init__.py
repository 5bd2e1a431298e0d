"""Mixture of Experts in the planner: what a MoE config holds (counts.py: total and active parameters per family,
without weights) and what its layouts cost (parallel.py: expert parallelism with DeepSpeed AutoEP against ZeRO-3
with the sparse block as leaf, memory, all-to-all traffic and the router's imbalance)."""

from harness.planner.moe.parallel import (AUTOEP_FAMILIES, DEFAULT_IMBALANCE, EP_STAGES, STATE_TERMS,
                                          activation_width, all_to_all_bytes, all_to_all_calls, comm_groups,
                                          ep_degrees, ep_problem, model_state_bytes, optimizer_shard, rank_params,
                                          routed_flops_per_token, split)

__all__ = ["AUTOEP_FAMILIES", "DEFAULT_IMBALANCE", "EP_STAGES", "STATE_TERMS", "activation_width", "all_to_all_bytes",
           "all_to_all_calls", "comm_groups", "ep_degrees", "ep_problem", "model_state_bytes", "optimizer_shard",
           "rank_params", "routed_flops_per_token", "split"]
