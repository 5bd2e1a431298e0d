"""`rl.generator=vllm` (CUDA only): a vLLM engine colocated on every rank, asleep while the trainer steps.

Each rank runs its own vLLM (tensor_parallel_size 1, distributed_executor_backend "external_launcher", as TRL's
colocate mode), built from the policy's config with load_format "dummy" (nothing read from disk): the policy's live
weights are its only source. Per generation:
    wake_up(weights) -> sync -> wake_up(kv_cache) -> generate -> sleep(level 2)
so between generations it holds nothing on the GPU and the trainer has its memory back (trl#2688). The sync walks
the policy's parameters in order and hands them to vLLM's load_weights in buckets of rl.sync_bucket_mb counted in
GATHERED bytes (ds_numel x element size: a partitioned ZeRO-3 parameter's numel() is 0, which collapsed TRL's buckets
into one, trl PR#6386); under ZeRO-3 one bucket is gathered at a time, so no rank ever holds the whole model for the
sync. LoRA: each adapted weight is sent merged (W + scale x B A) and the adapters stay unmerged in the policy.
after_step() marks the weights stale; the sync runs at the next generation (vLLM's weights are dropped in sleep).

Sampling: SamplingParams per row with seed row_seed(seed, first_row + i) (sampling.py), so rows are independent of
the batch layout as in the hf generator (vLLM's sampler, not transformers': the same seed gives other tokens than hf).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from harness.errors import UsageError
from harness.rl.generation.gather import gathered_bytes, is_zero3
from harness.rl.generation.sampling import row_seed

MIB = 1 << 20
SLEEP_LEVEL = 2  # drop weights and KV cache while asleep: they are synced again at the next generation


def unavailable() -> str | None:
    """Why vllm cannot run here (None: it can)."""
    import importlib.util

    if not torch.cuda.is_available():
        return f"rl.generator=vllm needs CUDA GPUs; this machine has none (torch {torch.__version__})"
    if importlib.util.find_spec("vllm") is None:
        return "rl.generator=vllm needs the vllm package, which is not installed"
    return None


def _model_dir(engine, tokenizer, root: Path) -> str:
    """The policy's config and tokenizer for vLLM's dummy load (no weights: they come from the sync)."""
    module = engine.module
    config = getattr(module, "config", None) or module.get_base_model().config
    root.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return str(root)


def _vllm_model(llm):
    """vLLM's torch model inside this process (the attribute path moved between vLLM versions)."""
    paths = ("llm_engine.model_executor.driver_worker.worker.model_runner.model",
             "llm_engine.model_executor.driver_worker.model_runner.model")
    for path in paths:
        obj = llm
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    raise RuntimeError("cannot reach vLLM's model to load weights (tried: " + ", ".join(paths) + ")")


def named_weights(module):
    """(HF name, parameter, LoRA parts) of the policy in order; LoRA-adapted weights under their base name with
    (A, B, scale) so the sync can merge them. Adapter tensors themselves are skipped."""
    lora = {}
    for name, sub in module.named_modules():
        if hasattr(sub, "lora_A") and hasattr(sub, "base_layer") and "default" in getattr(sub, "lora_A", {}):
            lora[f"{name}.base_layer.weight"] = (sub.lora_A["default"].weight, sub.lora_B["default"].weight,
                                                 float(sub.scaling["default"]))
    for name, param in module.named_parameters():
        if ".lora_" in name:
            continue
        yield name.replace(".base_layer", ""), param, lora.get(name)


def bucket_params(bucket: list) -> list:
    """A bucket's parameters to gather: each weight, and its LoRA A and B where adapted."""
    return [p for _, w, lora in bucket for p in (w, *(lora[:2] if lora else ()))]


def merged(w, lora) -> torch.Tensor:
    """The weight to send (inside the bucket's gather): W, or W + scale x B A for an adapted one."""
    return w.data if not lora else w.data + lora[2] * lora[1].data @ lora[0].data


def buckets(items: list, bucket_bytes: int) -> list[list]:
    """Consecutive items whose gathered bytes (the weight and its LoRA factors) reach at most bucket_bytes each
    (a tensor larger than a bucket goes alone)."""
    out, current, used = [], [], 0
    for item in items:
        size = gathered_bytes(item[1]) + (sum(map(gathered_bytes, item[2][:2])) if item[2] else 0)
        if current and used + size > bucket_bytes:
            out.append(current)
            current, used = [], 0
        current.append(item)
        used += size
    return out + [current] if current else out


class VLLMGenerator:
    name = "vllm"

    def __init__(self, rl: dict, engine, tokenizer, *, run=None, seed: int = 0, root: Path | None = None):
        why = unavailable()
        if why:
            raise UsageError(f"{why}\n    fix: run on a GPU node with vllm installed, or set rl.generator=hf")
        from vllm import LLM

        self.rl, self.engine, self.tokenizer = rl, engine, tokenizer
        self.seed, self.calls, self.stale = int(seed), 0, True
        self.last_logps: list[list[float]] = []
        self.bucket_bytes = int(float(rl.get("sync_bucket_mb", 256)) * MIB)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        folder = _model_dir(engine, tokenizer, Path(root or "/tmp") / f"vllm_policy_rank{rank}")
        self.llm = LLM(model=folder, load_format="dummy", tensor_parallel_size=1, enable_sleep_mode=True,
                       distributed_executor_backend="external_launcher", seed=self.seed,
                       gpu_memory_utilization=float(rl.get("vllm_gpu_memory_utilization", 0.3)),
                       max_model_len=int(rl.get("max_prompt_length", 512)) + int(rl.get("max_completion_length", 512)),
                       dtype=str(next(engine.module.parameters()).dtype).removeprefix("torch."))
        self.llm.sleep(level=SLEEP_LEVEL)
        self.last_sync = {"seconds": 0.0, "bytes": 0, "buckets": 0, "peak_bucket_bytes": 0}

    @torch.no_grad()
    def sync(self) -> dict:
        """The policy's weights into vLLM, bucket by bucket (collective under ZeRO-3: every rank walks them)."""
        import deepspeed

        began, model = time.perf_counter(), _vllm_model(self.llm)
        items = list(named_weights(self.engine.module))
        done = {"bytes": 0, "buckets": 0, "peak_bucket_bytes": 0}
        for bucket in buckets(items, self.bucket_bytes):
            params = bucket_params(bucket)
            with deepspeed.zero.GatheredParameters(params, enabled=is_zero3(self.engine.module)):
                tensors = [(n, merged(w, lora))
                           for n, w, lora in bucket]
                model.load_weights(tensors)
            size = sum(map(gathered_bytes, params))
            done = {"bytes": done["bytes"] + size, "buckets": done["buckets"] + 1,
                    "peak_bucket_bytes": max(done["peak_bucket_bytes"], size)}
        torch.cuda.synchronize()
        self.last_sync = {**done, "seconds": time.perf_counter() - began}
        return self.last_sync

    def generate(self, prompt_ids: list[list[int]], *, seed: int, first_row: int = 0,
                 row_ids: list[int] | None = None, max_new: int | None = None) -> list[list[int]]:
        """As the hf generator's: row i draws from (seed, row_ids[i] or first_row + i); with row_ids (a
        multi-turn turn) last_logps holds vLLM's log-prob of each sampled token (logprobs=0: the sampled one)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self.calls += 1
        self.llm.wake_up(tags=["weights"])
        self.sync()  # weights were dropped in sleep: every generation starts from the live policy
        self.llm.wake_up(tags=["kv_cache"])
        rl, rows = self.rl, row_ids if row_ids is not None else [first_row + i for i in range(len(prompt_ids))]
        params = [SamplingParams(n=1, max_tokens=int(max_new or rl.get("max_completion_length", 512)),
                                 temperature=float(rl.get("temperature", 1.0)), top_p=float(rl.get("top_p", 1.0)),
                                 top_k=int(rl.get("top_k") or 0) or -1, seed=row_seed(seed, row),
                                 logprobs=0 if row_ids is not None else None)
                  for row in rows]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        self.llm.sleep(level=SLEEP_LEVEL)
        self.stale = False
        if row_ids is not None:
            self.last_logps = [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                               for o in outs]
        return [list(o.outputs[0].token_ids) for o in outs]

    def after_step(self) -> None:
        """The policy moved: vLLM's copy is stale until the next generation's sync."""
        self.stale = True

    def state_dict(self) -> dict:
        return {"generator": self.name, "seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.calls = int(state["seed"]), int(state["calls"])
