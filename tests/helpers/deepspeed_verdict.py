"""DeepSpeed 0.19.8's own verdict on a DeepSpeed config, as a user's run would reach it: the HF Trainer and
accelerate fill their "auto" keys first (their real code), then DeepSpeedConfig decides at world N and, for a
config that names an optimizer, deepspeed.initialize builds an engine on a tiny Llama (one gloo process).

Used by tests/test_public_configs.py (and `deepspeed_accepts`, DeepSpeedConfig at world 1, by the recipe tests).
Nothing here re-implements a DeepSpeed check: every verdict is an exception raised (or not) by DeepSpeed,
transformers or accelerate. What is adapted to this CPU-only single process is
listed in `engine_config`.
"""
from __future__ import annotations

import ast
import contextlib
import copy
import inspect
import os
import textwrap
from functools import cache
from types import SimpleNamespace

RECIPE_DEFAULTS = {"description": "<recipe defaults>"}


def run_settings() -> dict:
    """The harness's run settings (recipe defaults): what stands in for TrainingArguments, so that HF's fill and
    the harness's fill start from the same values."""
    from harness.config.recipes import complete
    return complete(dict(RECIPE_DEFAULTS), "<recipe defaults>", ())


def training_args(world: int) -> SimpleNamespace:
    """The TrainingArguments fields HfTrainerDeepSpeedConfig reads, for `world` ranks."""
    r = run_settings()
    micro = r["batch"]["micro_batch_per_gpu"]
    return SimpleNamespace(
        world_size=world, per_device_train_batch_size=micro if isinstance(micro, int) else 1,
        gradient_accumulation_steps=r["batch"]["grad_accum_steps"] if isinstance(r["batch"]["grad_accum_steps"], int)
        else 1, max_grad_norm=r["gradient_clipping"], learning_rate=r["optimizer"]["lr"],
        adam_beta1=r["optimizer"]["betas"][0], adam_beta2=r["optimizer"]["betas"][1], adam_epsilon=r["optimizer"]["eps"],
        weight_decay=r["optimizer"]["weight_decay"], save_on_each_node=False, fp16=r["precision"] == "fp16",
        fp16_full_eval=False, bf16=r["precision"] == "bf16", bf16_full_eval=False,
        get_warmup_steps=lambda steps: r["scheduler"]["warmup_steps"], steps=r["train"]["steps"])


@cache
def accelerate_fills() -> dict:
    """The constant entries of accelerate's `config_kwargs` in Accelerator._prepare_deepspeed (what it fills
    whenever a key is "auto"), read from accelerate's installed source."""
    from accelerate.accelerator import Accelerator
    tree = ast.parse(textwrap.dedent(inspect.getsource(Accelerator._prepare_deepspeed)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "config_kwargs" for t in node.targets):
            return {ast.literal_eval(k): ast.literal_eval(v) for k, v in zip(node.value.keys, node.value.values)}
    raise AssertionError("accelerate's _prepare_deepspeed has no config_kwargs literal any more")


def hf_fill(cfg: dict, world: int, hidden_size: int) -> dict:
    """What the HF Trainer (+ accelerate) hands DeepSpeed: their real fill code on a copy, with TrainingArguments
    mismatches not enforced (the harness has no TrainingArguments to mismatch against)."""
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf = HfTrainerDeepSpeedConfig(copy.deepcopy(cfg))
    base = HfTrainerDeepSpeedConfig.fill_match
    hf.fill_match = lambda key, val, hf_key=None, must_match=True: base(hf, key, val, hf_key, False)
    hf.fill_only = hf.fill_match
    args = training_args(world)
    hf.trainer_config_process(args)
    hf.trainer_config_finalize(args, SimpleNamespace(config=SimpleNamespace(hidden_size=hidden_size)), args.steps)
    for key, value in accelerate_fills().items():
        hf.fill_only(key, value)
    return hf.config


class DataParallel:
    """A model-parallel unit (the interface Megatron's mpu offers) that tells DeepSpeedConfig the data-parallel
    world: how its batch rule is evaluated at N ranks inside one process."""

    def __init__(self, world: int):
        self.world = world

    def get_data_parallel_world_size(self) -> int:
        return self.world


ENV_KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def gloo_world_of_one():
    """A one-rank gloo process group in this process, for as long as the block runs; the environment and the
    process group are restored after, so later tests (and the ranks they launch) do not inherit RANK/WORLD_SIZE."""
    import deepspeed
    import deepspeed.comm as ds_dist
    saved = {k: os.environ.get(k) for k in ENV_KEYS}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    try:
        yield
    finally:
        ds_dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refusal(call) -> str | None:
    """None when `call()` passes, else the exception DeepSpeed raised, as "Type: first line"."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - any exception is DeepSpeed's refusal
        first = (str(e).strip().splitlines() or [""])[0]
        return f"{type(e).__name__}: {first}"[:300]
    return None


def config_verdict(filled: dict, world: int) -> str | None:
    """DeepSpeedConfig at `world` ranks (data-parallel world = world / sequence_parallel_size, as DeepSpeed takes it
    when a config gives sequence_parallel_size)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    dp = world // int(filled.get("sequence_parallel_size", 1) or 1)
    return refusal(lambda: DeepSpeedConfig(copy.deepcopy(filled), mpu=DataParallel(dp)))


def engine_config(filled: dict) -> dict:
    """The config for a one-process engine on CPU: the batch is 1 x 1 (the world-N batch is DeepSpeedConfig's),
    fp16 becomes bf16 (DeepSpeed refuses fp16 on CPU), AutoTP is off (it needs autotp_size ranks)."""
    cfg = copy.deepcopy(filled)
    for key in ("train_batch_size", "sequence_parallel_size"):
        cfg.pop(key, None)
    cfg.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    if isinstance(cfg.get("fp16"), dict) and cfg["fp16"].get("enabled") is True:
        cfg["fp16"] = {"enabled": False}
        cfg["bf16"] = {"enabled": True}
    if isinstance(cfg.get("tensor_parallel"), dict):
        cfg["tensor_parallel"]["autotp_size"] = 1
    return cfg


def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def engine_verdict(filled: dict) -> str | None:
    """deepspeed.initialize on a tiny Llama with the config's own optimizer (and scheduler), inside
    gloo_world_of_one()."""
    import deepspeed
    cfg = engine_config(filled)

    def build():
        model = tiny_llama()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        engine.destroy()
    return refusal(build)


WORLDS = (4, 8)


def deepspeed_cell(cfg: dict, hidden_size: int = 64) -> str:
    """DeepSpeed's verdict as the table writes it: "accepted", "refused at 4, 8 — <exception>", "refused at init —
    <exception>" (DeepSpeedConfig passes, the engine refuses), or accepted with the CPU-only op it lacks here."""
    refused = {w: config_verdict(hf_fill(cfg, w, hidden_size), w) for w in WORLDS}
    worlds = [w for w, r in refused.items() if r]
    init = engine_verdict(hf_fill(cfg, 1, hidden_size)) if "optimizer" in cfg and not worlds else None
    if init and "not been implemented on CPU" in init:
        return "accepted (its engine needs a CUDA op: " + init.split(": ", 1)[1][:40] + ")"
    if init:
        return "refused at init — " + _short(init)
    if worlds:
        return "refused at " + ", ".join(map(str, worlds)) + " — " + _short(refused[worlds[0]])
    return "accepted"


def _short(why: str) -> str:
    return why.split(". See")[0][:70].replace("|", "/").rstrip()


def harness_cell(path: str) -> str:
    """`harness validate PATH --world-size N` for N in WORLDS, as the table writes it: "accepted[, warns KEYS]" or
    "refused[ at N]: KEYS" (the keys its error lines name)."""
    import io
    from harness.cli import main
    seen = {}
    for w in WORLDS:
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(["validate", path, "--world-size", str(w)])
        lines = err.getvalue().splitlines()
        errors = sorted({ln.strip().split(": ")[0] for ln in lines if ln.startswith("  ") and not ln.startswith("    ")})
        warns = sorted({ln.split(".json:", 1)[1].split(": ")[0] for ln in lines if ln.startswith("warning:")})
        seen[w] = (rc, errors, warns)
    refused = [w for w in WORLDS if seen[w][0]]
    if refused:
        head = "refused" if refused == list(WORLDS) else "refused at " + ", ".join(map(str, refused))
        return head + ": " + "; ".join(seen[refused[-1]][1])
    return "accepted" + (", warns " + "; ".join(seen[WORLDS[-1]][2]) if seen[WORLDS[-1]][2] else "")


def refused_worlds(cell: str) -> set[int]:
    """The world sizes a table cell (either column) says are refused."""
    if cell.startswith("accepted"):
        return set()
    head = cell.split(" — ")[0].split(":")[0]
    if head in ("refused", "refused at init"):
        return set(WORLDS)
    return {int(w) for w in head[len("refused at "):].split(", ")}


def deepspeed_accepts(cfg: dict):
    """DeepSpeedConfig built offline sees world size 1, so give it the per-rank triple for one rank."""
    from deepspeed.runtime.config import DeepSpeedConfig

    one_rank = copy.deepcopy(cfg)
    one_rank["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"]
    return DeepSpeedConfig(one_rank)  # it mutates nested dicts: one_rank is already a deep copy
