"""Small shared pieces: is a step in the window, and gathering a per-rank value to every rank."""

from __future__ import annotations


def logged(step: int) -> int:
    """The trainer passes 0-based loop indices to hooks; records and windows use step + 1."""
    return step + 1


def in_window(step: int, window: tuple[int, int] | None) -> bool:
    return window is not None and window[0] <= logged(step) <= window[1]


def gather(obj) -> list:
    """[value of rank 0, value of rank 1, ...] on every rank (torch.distributed, so never comms-logged)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def median(values: list[float]) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
