"""GPU check, a vLLM-served teacher (bench/gpu_check.sh case distill_served): the precomputed store written from the
teacher on this GPU (transformers, bf16) against the same store written from `vllm serve` of the same folder through
harness/distill/served.py (/v1/completions with prompt_logprobs), then the server killed mid-run.

    python bench/gpu_check_distill.py --out DIR [--k 8] [--rows 64] [--seq-len 512] [--port 8011]

The grpo_vllm case's Qwen2-shaped folder (~0.3B, seeded random weights, bf16, the shipped tokenizer) is written
under DIR/model; the server is started as

    vllm serve DIR/model --port PORT --dtype bfloat16 --max-logprobs K --max-model-len SEQ_LEN
               --gpu-memory-utilization 0.3 --enforce-eager

Temperature 1 (vLLM's prompt log-probs are the raw model's unless --logprobs-mode says otherwise). Reported in
DIR/summary.json: the share of loss tokens whose top-1 id agrees, the largest |log-prob| difference where the ids
agree (bf16 kernels differ between vLLM and transformers), the forward-KL top-k loss of a random student from each
store and their ratio, the write time of each store, and after the kill: the error's text and the seconds it took
(two 10 s timeouts and the backoff at most, never a hang). Skips itself (exit 0, says why) without vllm.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from distill_store import rows  # noqa: E402  the same rows as the CPU store benchmark
from gpu_check_rl import folder as teacher_folder  # noqa: E402  the grpo_vllm case's ~0.3B Qwen2 folder


def start_vllm(folder: str, port: int, k: int, seq_len: int, log: Path) -> subprocess.Popen:
    cmd = ["vllm", "serve", folder, "--port", str(port), "--dtype", "bfloat16", "--max-logprobs", str(k),
           "--max-model-len", str(seq_len), "--gpu-memory-utilization", "0.3", "--enforce-eager"]
    print("[distill_served]", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait_for(served, server: subprocess.Popen, limit_s: float = 300.0):
    """The client once the server answers /health (vLLM loads for a minute or two)."""
    from harness.distill.served import TeacherServerError

    started = time.monotonic()
    while True:
        try:
            return served.connect()
        except TeacherServerError:
            if server.poll() is not None or time.monotonic() - started > limit_s:
                raise
            time.sleep(3)


def write_store(folder: Path, teacher, ids, labels, k: int):
    import torch

    from harness.distill.teacher_store import ensure_teacher_store, store_key, store_path

    def batch(row_ids):
        return torch.from_numpy(ids[row_ids]), torch.from_numpy(labels[row_ids])
    key = store_key(teacher="gpu_check", weights=[], data={"seq_len": ids.shape[1]}, k=k, temperature=1.0,
                    precision="bf16")
    return ensure_teacher_store(store_path(folder, key), key, num_rows=len(ids), batch=batch, teacher=teacher,
                                micro=8, vocab_size=512)[0]


def compare(local, served, labels) -> dict:
    import numpy as np
    import torch

    from harness.distill.topk_loss import topk_loss_sum

    a, b = local.rows(np.arange(len(labels))), served.rows(np.arange(len(labels)))
    same = a.ids[:, 0] == b.ids[:, 0]
    student = torch.randn(*labels.shape, 512, generator=torch.Generator().manual_seed(0))
    lab = torch.from_numpy(labels)
    loss_a = float(topk_loss_sum(student, lab, a, beta=0.0, temperature=1.0))
    loss_b = float(topk_loss_sum(student, lab, b, beta=0.0, temperature=1.0))
    return {"tokens": len(a), "top1_agree": float(same.float().mean()),
            "max_abs_logp_diff_top1": float((a.logps[same, 0] - b.logps[same, 0]).abs().max()),
            "loss_precomputed": loss_a, "loss_served": loss_b, "loss_ratio": loss_b / loss_a,
            "write_s_precomputed": local.meta["write_s"], "write_s_served": served.meta["write_s"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--port", type=int, default=8011)
    args = parser.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        print(f"[distill_served] skipped: vllm does not import ({err})")
        return 0
    import torch
    from transformers import AutoModelForCausalLM

    from harness.distill.served import ServedTeacher, TeacherServerError
    from harness.distill.topk import teacher_topk

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    folder = teacher_folder(out)
    ids, labels = rows(args.rows, args.seq_len, 512)
    server = start_vllm(folder, args.port, args.k, args.seq_len, out / "vllm.log")
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.bfloat16).cuda().eval()

        def local(input_ids, row_labels):
            with torch.no_grad():
                return teacher_topk(model(input_ids=input_ids.cuda(), use_cache=False).logits, row_labels, args.k, 1.0)
        precomputed = write_store(out / "precomputed", local, ids, labels, args.k)
        served = wait_for(ServedTeacher(f"http://127.0.0.1:{args.port}", args.k, 1.0, timeout_s=10.0, retries=1),
                          server)
        summary = compare(precomputed, write_store(out / "served", served, ids, labels, args.k), labels)
        server.kill()
        server.wait()
        started = time.monotonic()
        try:
            served(torch.from_numpy(ids[:2]), torch.from_numpy(labels[:2]))
            summary["after_kill"] = "answered (unexpected)"
        except TeacherServerError as err:
            summary["after_kill"] = str(err)
        summary["after_kill_s"] = round(time.monotonic() - started, 2)
    finally:
        server.kill()
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"[distill_served] top-1 agrees on {summary['top1_agree']:.1%} of {summary['tokens']} tokens, "
          f"max |dlogp| {summary['max_abs_logp_diff_top1']:.3g}, loss served / precomputed "
          f"{summary['loss_ratio']:.4f}; after the kill: {summary['after_kill_s']} s: "
          f"{summary['after_kill'].splitlines()[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
