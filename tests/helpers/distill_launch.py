"""The distillation tests' real DeepSpeed runs, in ONE 2-rank launch (conftest's distill_runs, tests/drivers/jobs.py):
each launch costs ~20-40 s of start-up on the loaded 2-core machine, the jobs themselves seconds. Each test file
keeps its assertions and reads its share by case name:
  - tests/test_distill.py (under ROOT/gkd): gkd on the dataset's completions against plain torch (CASES), on-policy
    lmbda 1 with a resume at step 3 and their rollouts.jsonl, the teacher's completions (seq_kd on ZeRO-3),
    objective distill;
  - tests/test_distill_topk_run.py (under ROOT/topk): precomputed and served top-k teachers (TOPK_CASES), and a
    served run whose server dies after its first answer (exit 69);
  - tests/test_teacher_store.py (under ROOT/store): the precomputed store written by a ZeRO-3 teacher engine on 2
    ranks (tests/drivers/teacher_store.py's `write`, called in the same process group);
  - tests/test_planner_distill.py (under ROOT/bytes): a ZeRO-3 teacher engine's bytes per rank
    (tests/drivers/teacher_bytes.py's `measure`, called the same way).
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from harness.dist import free_port
from helpers.distill_ref import Case, sharpened_folder, write_completions
from helpers.launch import job_output, launch_jobs, set_args
from helpers.models import llama_folder, qwen2_folder

# --- tests/test_distill.py's cases ---
STEPS, SEQ_LEN, MICRO, LR, EVAL_FRACTION = 2, 24, 2, 1.0, 0.25
CASES = [Case("ddp_forward_kl", "ddp", 0.0),
         Case("ddp_reverse_kl", "ddp", 1.0),
         Case("zero2_jsd_t09_ga2_ce", "zero2", 0.5, 0.9, gas=2, ce_alpha=0.5),
         Case("zero3_reverse_kl_t09", "zero3", 1.0, 0.9),
         Case("zero3_forward_kl_t09_ga2", "zero3", 0.0, 0.9, gas=2),
         Case("zero2_lora_adapter_jsd_ce", "zero2", 0.5, ce_alpha=1.0, lora=True)]
ON_POLICY_STEPS = 6


def argv(root: Path, case: Case) -> list[str]:
    sets = {"precision": "fp32", "train.steps": STEPS, "train.seq_len": SEQ_LEN, "train.save_every": STEPS,
            "train.eval_every": STEPS, "train.log_every": 1, "scheduler.type": "none", "optimizer.type": "sgd",
            "optimizer.lr": LR, "optimizer.weight_decay": 0, "gradient_clipping": 0,
            "batch.micro_batch_per_gpu": MICRO, "batch.grad_accum_steps": case.gas, "batch.train_batch_size": '"auto"',
            "train.eval_fraction": EVAL_FRACTION, "train.model": root / "student", "train.dataset": root / "data.jsonl",
            "train.objective": "gkd", "distill.lmbda": 0, "distill.beta": case.beta, "distill.ce_alpha": case.ce_alpha,
            "distill.loss_chunk_tokens": 7}  # several chunks per micro-batch, the last one short
    if case.loss_temperature is not None:
        sets["distill.loss_temperature"] = case.loss_temperature
    if case.lora:
        sets.update({"adapter.type": "lora", "adapter.dropout": 0})
    else:
        sets["distill.teacher_model_name_or_path"] = root / "teacher"
    return ["--recipe", case.recipe, "--output-dir", str(root / case.name), *set_args(sets)]


def on_policy_argv(root: Path, name: str, resume: str | None = None, gas: int = 2, steps: int = ON_POLICY_STEPS,
                   recipe: str = "zero2", extra_sets: dict | None = None) -> list[str]:
    """gkd with lmbda 1 (every completion the student's own) on ZeRO-2 with accumulation, Adam; saved at step 3."""
    sets = {"precision": "fp32", "train.steps": steps, "train.seq_len": SEQ_LEN, "train.save_every": 3,
            "train.eval_every": 0, "train.log_every": 1, "scheduler.type": "none", "optimizer.lr": 0.01,
            "batch.micro_batch_per_gpu": MICRO, "batch.grad_accum_steps": gas, "batch.train_batch_size": '"auto"',
            "train.model": root / "student", "train.dataset": root / "data.jsonl", "train.objective": "gkd",
            "distill.lmbda": 1, "distill.max_new_tokens": 8, "distill.teacher_model_name_or_path": root / "teacher",
            **(extra_sets or {})}
    extra = ["--resume", str(root / name.removesuffix("_resumed") / "checkpoints" / resume)] if resume else []
    return ["--recipe", recipe, "--output-dir", str(root / name), *set_args(sets), *extra]


SEQ_KD = {"distill.lmbda": 0.5, "distill.seq_kd": "true", "distill.max_new_tokens": 6}


def seq_kd_argv(root: Path) -> list[str]:
    """seq_kd on ZeRO-3: each row drawn for the student (lmbda 0.5) or the teacher engine (sharded, generating in
    lockstep through its gathers), 2 steps of 2 ranks x 2 rows."""
    return on_policy_argv(root, "seq_kd", gas=1, steps=2, recipe="zero3", extra_sets=SEQ_KD)


STALE_STEPS = range(1, ON_POLICY_STEPS + 1)  # on_policy_resumed's rollouts.jsonl before it runs: a stale line per step


def prompts_only_argv(root: Path) -> list[str]:
    return ["--recipe", "ddp", "--output-dir", str(root / "distill_prompts"), *set_args({
        "precision": "fp32", "train.steps": 2, "train.seq_len": SEQ_LEN, "train.eval_every": 2, "train.log_every": 1,
        "batch.micro_batch_per_gpu": MICRO, "train.model": root / "student", "train.dataset": root / "data.jsonl",
        "train.objective": "distill", "distill.max_completion_length": 6,
        "distill.teacher_model_name_or_path": root / "teacher"})]


# --- tests/test_distill_topk_run.py's cases ---
TOPK_STEPS, TOPK_RECORDS = 2, 8
WORDS = "alpha beta gamma delta river stone cloud green seven quiet paper music light north".split()
TOPK_CASES = {  # name: (recipe, teacher mode, k, beta, loss temperature)
    "precomputed_zero3_k4": ("zero3", "precomputed", 4, 0.0, 0.9),
    "precomputed_ddp_k1_jsd": ("ddp", "precomputed", 1, 0.5, 1.0),
    "precomputed_zero3_k4_again": ("zero3", "precomputed", 4, 0.0, 0.9),
    "served_zero2_k4": ("zero2", "served", 4, 0.0, 0.9),
}


def write_records(path: Path) -> Path:
    rng = random.Random(5)
    phrase = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    path.write_text("".join(json.dumps({"prompt": phrase(2, 5), "completion": " " + phrase(1, 9)}) + "\n"
                            for _ in range(TOPK_RECORDS)))
    return path


def sharpen(folder: str, scale: float = 6.0) -> str:
    """The folder's output head scaled in place: a peaked teacher, far from the random student."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(folder)
    return folder


def topk_argv(root: Path, name: str, url: str = "", steps: int = TOPK_STEPS, timeout_s: float = 60,
              retries: int = 2) -> list:
    recipe, mode, k, beta, temperature = TOPK_CASES.get(name, TOPK_CASES["served_zero2_k4"])
    sets = {"precision": "fp32", "train.steps": steps, "train.seq_len": SEQ_LEN, "train.save_every": 100,
            "train.eval_every": 0, "train.eval_fraction": 0, "train.log_every": 1, "scheduler.type": "none",
            "optimizer.type": "sgd", "optimizer.lr": LR, "optimizer.weight_decay": 0, "gradient_clipping": 0,
            "batch.micro_batch_per_gpu": 2, "batch.grad_accum_steps": 2, "batch.train_batch_size": '"auto"',
            "train.model": root / "student", "train.dataset": root / "data.jsonl", "train.objective": "gkd",
            "train.store_dir": root / "stores", "distill.lmbda": 0, "distill.beta": beta,
            "distill.loss_temperature": temperature, "distill.teacher_model_name_or_path": root / "teacher",
            "distill.teacher_mode": mode, "distill.loss_top_k": k, "distill.loss_chunk_tokens": 7,
            "distill.teacher_timeout_s": timeout_s, "distill.teacher_retries": retries}
    if mode == "served":
        sets["distill.teacher_model_server_url"] = url
    return ["--recipe", recipe, "--output-dir", str(root / name), *set_args(sets)]


# --- tests/test_teacher_store.py's case ---
STORE_ROWS, STORE_K, STORE_T = 7, 4, 0.9


@dataclass
class DistillRuns:
    root: Path  # ROOT: gkd/, topk/, store/ below it
    proc: object  # the launch's CompletedProcess
    seconds: float  # the launch's wall time
    names: list[str]  # the cases in launch order
    dies_port: int  # the port of the served teacher that died after its first answer

    def out(self, name: str, stream: str = "stdout") -> str:
        """One case's share of the launch's stdout or stderr."""
        return job_output(getattr(self.proc, stream), self.names.index(name))


def prepare(root: Path) -> None:
    gkd, topk = root / "gkd", root / "topk"
    llama_folder(gkd / "student", layers=1)
    sharpened_folder(llama_folder(gkd / "teacher_raw", seed=77, layers=3), gkd / "teacher")
    write_completions(gkd / "data.jsonl")
    (gkd / "on_policy_resumed").mkdir()  # an earlier attempt's lines: the resume keeps steps 1-3, replaces 4-6
    (gkd / "on_policy_resumed" / "rollouts.jsonl").write_text("".join(json.dumps({"step": s, "stale": True}) + "\n"
                                                                      for s in STALE_STEPS))
    llama_folder(topk / "student", layers=1)
    sharpen(llama_folder(topk / "teacher", seed=77, layers=2))
    write_records(topk / "data.jsonl")
    qwen2_folder(root / "store" / "qwen2")
    llama_folder(root / "bytes" / "teacher", layers=4)  # twice tiny-llama's depth, its tokenizer


def cases(root: Path, url: str, dies_url: str) -> dict[str, object]:
    gkd, topk, store = root / "gkd", root / "topk", root / "store"
    out: dict[str, object] = {c.name: argv(gkd, c) for c in CASES}
    out["on_policy"] = on_policy_argv(gkd, "on_policy")
    out["on_policy_resumed"] = on_policy_argv(gkd, "on_policy_resumed", resume="global_step3")
    out["distill_prompts"] = prompts_only_argv(gkd)
    out["seq_kd"] = seq_kd_argv(gkd)
    for name in TOPK_CASES:
        out[name] = topk_argv(topk, name, url, steps=1 if name.endswith("again") else TOPK_STEPS)
    out["served_dies"] = {"argv": topk_argv(topk, "served_dies", dies_url, timeout_s=5, retries=1), "code": 69}
    out["store_zero3"] = {"call": "drivers.teacher_store:write",
                          "args": [str(store / "qwen2"), str(store / "ranked"), STORE_ROWS, STORE_K, STORE_T]}
    out["teacher_bytes"] = {"call": "drivers.teacher_bytes:measure", "args": [str(root / "bytes" / "bytes.json"),
                            *teacher_bytes_argv(root / "bytes")]}
    return out


def teacher_bytes_argv(where: Path) -> list[str]:
    """gkd on ZeRO-3 with the 4-layer teacher at WHERE/teacher (tests/test_planner_distill.py plans the same)."""
    return ["--recipe", "zero3", *set_args({"train.model": "tiny-llama", "train.objective": "gkd",
                                            "distill.teacher_model_name_or_path": where / "teacher",
                                            "distill.lmbda": 0, "precision": "fp32"}),
            "--output-dir", str(where / "run")]


def launch_distill_runs(root: Path) -> DistillRuns:
    """Every case in one 2-rank launch, with the topk cases' teacher server up in this process and a second one
    (a process of its own) that dies after its first answer."""
    from helpers.teacher_server import serve, start as start_server

    prepare(root)
    server = serve(str(root / "topk" / "teacher"))
    port = free_port()
    dying = start_server(root / "topk" / "teacher", port, "--stop-after", "1")
    try:
        jobs = cases(root, f"http://127.0.0.1:{server.server_address[1]}", f"http://127.0.0.1:{port}")
        started = time.perf_counter()
        proc = launch_jobs(list(jobs.values()), root, ranks=2, timeout_s=1200)
        return DistillRuns(root, proc, time.perf_counter() - started, list(jobs), port)
    finally:
        server.shutdown()
        dying.kill()
        dying.wait()
