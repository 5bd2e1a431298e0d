"""The two NVMe (ZeRO-Infinity, zero3_nvme) runs of the suite, which share ONE 2-rank launch (conftest's
nvme_runs, tests/drivers/jobs.py): test_training's parity run (fp32, the parity settings) and test_profiling's
swap-buffer run (4 steps, small swap buffers). Each writes its swap files under its own folder."""

from __future__ import annotations

from pathlib import Path

from helpers.launch import launch_jobs
from helpers.parity import COMMON

SWAP_ELEMS, SWAP_COUNT = 1_000_000, 3  # the swap run's param buffers: not DeepSpeed's 5 x 1e8 (1 GB pinned per rank)


def cases(root: Path) -> dict[str, list[str]]:
    return {
        "parity": ["--recipe", "zero3_nvme", "--set", "precision=fp32", "--set", f"zero.nvme_path={root / 'parity_nvme'}",
                   "--output-dir", str(root / "parity"), *COMMON],
        "swap": ["--recipe", "zero3_nvme", "--set", f"zero.nvme_path={root / 'swap_nvme'}", "--set", "train.steps=4",
                 "--set", "train.seq_len=64", "--profile-steps", "2-3", "--set", "train.eval_every=0",
                 "--set", f"deepspeed.zero_optimization.offload_param.buffer_size={SWAP_ELEMS}",
                 "--set", f"deepspeed.zero_optimization.offload_param.buffer_count={SWAP_COUNT}",
                 "--output-dir", str(root / "swap")],
    }


def launch_nvme_runs(root: Path) -> Path:
    """Both runs, one after the other in one process group; returns the root (run folders by name, swap files
    under NAME_nvme)."""
    launch_jobs(list(cases(root).values()), root)
    return root
