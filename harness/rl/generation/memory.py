"""What this rank has free for the generator's gathered weights and KV cache: the accelerator's free memory, or on
CPU the host's available memory shared by the ranks of this node."""

from __future__ import annotations

import os


def free_bytes() -> int:
    import torch

    if torch.cuda.is_available():
        return int(torch.cuda.mem_get_info()[0])
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    with open("/proc/meminfo") as fh:
        info = dict(line.split(":", 1) for line in fh)
    return int(info["MemAvailable"].split()[0]) * 1024 // max(ranks, 1)
