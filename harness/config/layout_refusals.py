"""The layouts an objective with its own step refuses (preference, rl, distill): pipeline, tensor and sequence
parallel, the tiled LM loss and the MoE balancing loss, each with the objective's own reason. Pure."""

from __future__ import annotations

from harness.config.resolve import degrees, sequence_parallel
from harness.errors import Problem


def refused_layouts(ds: dict, recipe: dict, goal: str, why: dict[str, str], fix_tail: str = "", *,
                    tiled: str, loss_name: str) -> list[Problem]:
    """why: {"parallel.pipeline" | "parallel.tensor" | "parallel.sequence": the reason}; tiled: the tiled-loss
    problem's reason; loss_name: the objective's loss in words ("the RL loss")."""
    pp, tp = degrees(ds, recipe)
    degree = {"parallel.pipeline": pp, "parallel.tensor": tp, "parallel.sequence": sequence_parallel(ds)}
    out = [Problem(key, f"{key.split('.')[1]} {degree[key]} with objective {goal} is not implemented: {reason}",
                   f"set {key}=1 (ZeRO-3 with CPU offload shards a model as far){fix_tail}")
           for key, reason in why.items() if degree[key] > 1]
    if recipe.get("train", {}).get("tiled_loss"):
        out.append(Problem("train.tiled_loss", f"the tiled LM loss with objective {goal}: {tiled}",
                           "set train.tiled_loss=false"))
    if recipe.get("moe", {}).get("aux_loss"):
        out.append(Problem("moe.aux_loss", f"the router's balancing loss with objective {goal} is not implemented "
                           f"({loss_name} would leave it out)", "set moe.aux_loss=false"))
    return out
