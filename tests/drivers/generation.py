"""The hf generator against one process's HF generate, on 2 ranks:
deepspeed --num_gpus 2 tests/drivers/generation.py MODEL_FOLDER OUT.json TOOL_MODEL_FOLDER

Each case builds the policy engine (ZeRO-3 whole gather, ZeRO-3 grouped gather, ZeRO-3 grouped with parameter
offload, ZeRO-3 grouped with LoRA, ZeRO-2), generates greedy completions (top_k 1) for this rank's prompts, then
rebuilds the same weights in a plain model (no DeepSpeed: gathered once and copied) and runs transformers' generate
on it; then one Adam step changes the weights and both generate again. It records the completions of both, the
whole-held parameter bytes at every module's forward during generation (the peak, against planner/rl.py's), the
layer groups the generator used, and whether sampled completions repeat for a seed and differ across seeds. Then
a multi-turn case (multi_turn_case): the tool model's rollouts on ZeRO-3 against the planner's bound.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

from harness.dist import exit_now  # noqa: E402

MAX_NEW = 10
LORA = {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj"],
        "modules_to_save": [], "use_rslora": False, "use_dora": False}
THRESHOLD = 100  # elements: the norms (64) stay whole, every matrix and the LoRA A/B are partitioned
CASES = {  # name: (zero_optimization, rl.gather_mb, lora)
    "z3_whole": ({"stage": 3}, None, False),
    "z3_groups": ({"stage": 3}, "one_layer", False),
    "z3_offload_groups": ({"stage": 3, "offload_param": {"device": "cpu"}}, "two_layers", False),
    "z3_lora_groups": ({"stage": 3}, "one_layer", True),
    "z2": ({"stage": 2}, None, False),
}


def prompts(rank: int) -> list[list[int]]:
    base = [[5, 17, 33, 2, 90, 41], [7, 8], [100, 200, 300, 11], [250, 3, 19, 60, 61]]
    return [[(t * (rank + 1) + 13 * rank) % 500 + 4 for t in p] for p in base]


def ds_config(zero: dict) -> dict:
    zero = dict(zero)
    if zero["stage"] == 3:
        zero["stage3_param_persistence_threshold"] = THRESHOLD
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": zero, "optimizer": {"type": "Adam", "params": {"lr": 0.05}},
            "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False}


def plain_generate(folder, state, lora, rows, eos, pad):
    """transformers' generate on a plain model holding `state` (one process, no DeepSpeed)."""
    import torch
    from transformers import GenerationConfig

    from harness.model import adapters
    from harness.model.hf import build_model
    from harness.rl.generation.hf import cut, left_pad

    model = build_model(folder, seed=0)
    if lora:
        adapters.apply(model, {"adapter": LORA, "train": {"seed": 0}, "activation_checkpointing": False})
    model.load_state_dict(state)
    model.eval()
    ids, mask = left_pad(rows, pad, "cpu")
    cfg = GenerationConfig(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=eos, pad_token_id=pad)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
    return [cut(r, set(eos)) for r in out[:, ids.shape[1]:].tolist()]


def whole_state(module) -> dict:
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(module.parameters())):
        return {k: v.detach().clone() for k, v in module.state_dict().items()}


class Tokens:
    """The shipped tokenizer's ids with EOS set to tokens this random model emits often, so rows stop at different
    steps on each rank (generate's synced_gpus path under grouped gathers)."""

    eos_token_id = [9, 51, 77, 226, 254, 312, 417]
    pad_token_id = 0


class HookFetches:
    """Counts ZeRO-3's own hook fetches (PartitionedParameterCoordinator.fetch_sub_module) while installed."""

    def __init__(self):
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as ppc

        self.cls, self.original, self.calls = ppc, ppc.fetch_sub_module, 0

        def counting(coordinator, *args, **kwargs):
            self.calls += 1
            return self.original(coordinator, *args, **kwargs)

        ppc.fetch_sub_module = counting

    def close(self):
        self.cls.fetch_sub_module = self.original


class PeakHeld:
    """Whole-held parameter bytes (p.data: empty for a released ZeRO-3 partition) at every module's forward."""

    def __init__(self, module):
        self.params = list(module.parameters())
        self.peak = 0
        self.handles = [m.register_forward_pre_hook(self.sample) for m in module.modules()]

    def sample(self, *_):
        self.peak = max(self.peak, sum(p.data.numel() * p.element_size() for p in self.params))

    def close(self):
        for h in self.handles:
            h.remove()


def bound_mb(spec, count) -> float | None:
    from harness.planner import rl as plan

    if spec is None:
        return None
    _, outside, layer = plan.zero3_pieces(count, lp=4, threshold=THRESHOLD, hidden=64)
    layers = 1 if spec == "one_layer" else 2
    return (outside + layers * layer + 1) / plan.MIB


def case(name, folder, tok) -> dict:
    import deepspeed
    import torch

    from harness.model import adapters
    from harness.model.hf import build_model
    from harness.planner import rl as rl_plan
    from harness.rl.generation import make_generator

    from harness.planner.params import count_module

    zero, gather, lora = CASES[name]
    ds = ds_config(zero)
    plain = build_model(folder, seed=0)
    if lora:
        adapters.apply(plain, {"adapter": LORA, "train": {"seed": 0}, "activation_checkpointing": False})
    count = count_module(plain)
    model = build_model(folder, seed=0, zero3_init_config=ds if zero["stage"] == 3 else None)
    if lora:
        adapters.apply(model, {"adapter": LORA, "train": {"seed": 0}, "activation_checkpointing": False})
    engine = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                  config=ds)[0]
    mb = bound_mb(gather, count)
    rl = {"generator": "hf", "max_completion_length": MAX_NEW, "top_k": 1, "gather_mb": "auto" if mb is None else mb}
    gen = make_generator(rl, engine, tok, None)
    rank = torch.distributed.get_rank()
    rows = prompts(rank)
    eos = tok.eos_token_id
    pad = tok.pad_token_id
    plan = rl_plan.gather_plan(count, lp=4, threshold=THRESHOLD, hidden=64, stage=zero["stage"],
                               bound_bytes=None if mb is None else int(mb * rl_plan.MIB))
    out, peaks = {"bound_mb": mb, "count": count.to_dict(), "persistent": count.persistent_numel(THRESHOLD),
                  "plan": plan.to_dict(), "hook_fetches": 0}, []
    for phase in ("before", "after"):
        held, fetches = PeakHeld(engine.module), HookFetches()
        out[f"{phase}_gen"] = gen.generate(rows, seed=7)
        held.close()
        fetches.close()
        out["hook_fetches"] += fetches.calls
        peaks.append(held.peak)
        out[f"{phase}_groups"] = gen.last_groups
        out[f"{phase}_ref"] = plain_generate(folder, whole_state(engine.module), lora, rows, eos, pad)
        if phase == "before":
            batch = torch.tensor([r[:2] * 4 for r in rows])
            fetches = HookFetches()  # the training forward goes through ZeRO-3's hooks again (they are back)
            loss = engine(input_ids=batch, labels=batch).loss
            fetches.close()
            out["train_hook_fetches"] = fetches.calls
            engine.backward(loss)
            engine.step()
            gen.after_step()
    out["peak_held_bytes"] = max(peaks)
    sampled = {"top_k": None, "temperature": 1.0}
    gen.rl = dict(rl, **sampled)
    out["sampled"] = [gen.generate(rows, seed=s) for s in (11, 11, 12)]
    return out


MULTI_TURN = {"generator": "hf", "max_completion_length": 160, "temperature": 1.0, "top_k": None,
              "max_tool_calling_iterations": 3, "chat_template_kwargs": {}, "tool_timeout_s": None,
              "max_tool_result_tokens": None, "reward_errors": "stop", "tools": []}


def multi_turn_case(folder: str) -> dict:
    """The tool model (tests/helpers/tool_models.py) on ZeRO-3 in one-layer groups, 4 SecretEnv rollouts per rank
    through harness/rl/multiturn.py: the whole-held bytes over every turn's generate call, each call's padded
    sequences x tokens (its KV cache), against planner/rl.py's gather peak and KV cache for the rollout budget."""
    import deepspeed
    import torch

    from helpers.tool_models import ENV_FILE, SECRETS, tool_tokenizer

    from harness.model.hf import build_model
    from harness.planner import rl as rl_plan
    from harness.planner.params import count_module, model_shape
    from harness.rl.generation import make_generator
    from harness.rl.multiturn import MultiTurn
    from harness.rl.tools import load_toolbox

    ds, tok = ds_config({"stage": 3}), tool_tokenizer()
    count = count_module(build_model(folder, seed=0))
    model = build_model(folder, seed=0, zero3_init_config=ds)
    engine = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds)[0]
    mb = bound_mb("one_layer", count)
    rl = {**MULTI_TURN, "gather_mb": mb, "environment_factory": f"{ENV_FILE}:SecretEnv"}
    box, gen = load_toolbox(rl, Path(folder)), make_generator(rl, engine, tok, None)
    calls, generate = [], gen.generate

    def recorded(prompt_ids, **kwargs):
        out = generate(prompt_ids, **kwargs)
        # (rows, the padded batch's tokens); a rank whose rows all finished still calls generate with none
        calls.append((len(prompt_ids), max(map(len, prompt_ids), default=0) + max(map(len, out), default=0)))
        return out

    gen.generate = recorded
    prompt = [{"role": "user", "content": "What is the secret word? Ask the tool."}]
    ids = tok.apply_chat_template(prompt, tools=box.schemas[None], add_generation_prompt=True, tokenize=True,
                                  return_dict=True)["input_ids"]
    rank = torch.distributed.get_rank()
    loop = MultiTurn(rl, tok, box, gen)
    rows = loop.start([prompt] * 4, [ids] * 4, {"secret": list(SECRETS[4 * rank:4 * rank + 4])},
                      list(range(4 * rank, 4 * rank + 4)), [f"row {4 * rank + i}" for i in range(4)])
    held, fetches = PeakHeld(engine.module), HookFetches()
    loop.run(rows, seed=3 + 5 * rank)  # the ranks' rows take different numbers of turns
    held.close()
    fetches.close()
    shape = model_shape(engine.module.config.to_dict())
    return {"peak_held_bytes": held.peak, "hook_fetches": fetches.calls, "calls": calls,
            "turns": [len(r.turns) for r in rows], "completion": [len(r.completion) for r in rows],
            "kv_bytes": max(rl_plan.kv_cache_bytes(shape, sequences=n, tokens=t, lp=4) for n, t in calls),
            "plan": rl_plan.gather_plan(count, lp=4, threshold=THRESHOLD, hidden=64, stage=3,
                                        bound_bytes=int(mb * rl_plan.MIB)).to_dict(),
            "plan_kv_bytes": rl_plan.kv_cache_bytes(shape, sequences=4, tokens=len(ids) + 160, lp=4)}


def main(folder: str, path: str, tool_folder: str) -> None:
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    tok = Tokens()
    results = {"rank": int(os.environ["RANK"])}
    for name in CASES:
        results[name] = case(name, folder, tok)
    results["z3_multi_turn"] = multi_turn_case(tool_folder)
    with open(f"{path}.rank{results['rank']}", "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    from harness.startup import quick_start

    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")])
    exit_now(0)
