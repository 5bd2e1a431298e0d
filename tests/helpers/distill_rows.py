"""Rows for the teacher tests: prompt + completion token ids, right-padded, labels -100 on the prompt and the
padding (each row a different length, some rows shorter than others), and a local teacher over them."""

from __future__ import annotations

import numpy as np
import torch

from harness.distill.topk import teacher_topk


def rows(num_rows: int, seq_len: int = 24, vocab: int = 512, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    gen = np.random.default_rng(seed)
    ids = gen.integers(3, vocab, size=(num_rows, seq_len)).astype(np.int64)
    labels = np.full_like(ids, -100)
    for r in range(num_rows):
        prompt = int(gen.integers(2, seq_len // 2))
        end = int(gen.integers(prompt + 1, seq_len + 1))
        labels[r, prompt:end] = ids[r, prompt:end]
        ids[r, end:] = 0  # padding
    return ids, labels


def batch_fn(ids: np.ndarray, labels: np.ndarray):
    def batch(row_ids):
        return torch.from_numpy(ids[row_ids]), torch.from_numpy(labels[row_ids])
    return batch


def local_teacher(model, k: int, temperature: float):
    """teacher(input_ids, labels) -> TopK from a module's forward (an HF model or a DeepSpeed engine)."""
    def teacher(input_ids, labels):
        with torch.no_grad():
            logits = model(input_ids=input_ids, use_cache=False).logits
        return teacher_topk(logits, labels, k, temperature)
    return teacher
