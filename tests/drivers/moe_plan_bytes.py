"""The planner's MoE bytes per rank against a live DeepSpeed engine, several layouts in ONE process group:
deepspeed --num_gpus 2 tests/drivers/moe_plan_bytes.py OUT.json

Each rank builds the same tiny Qwen3-MoE (transformers' config class, fp32, random weights), hands it to
deepspeed.initialize with a plain ds config per case (ZeRO-2 with DeepSpeed AutoEP at ep 2, ZeRO-3 with the sparse
block as leaf module), trains one step and counts the model states the engine holds after it
(harness.profiling.memory.model_state_bytes, the counter the dense "planner bytes equal the live engine's" tests
use) and the all_to_all_single bytes DeepSpeed's comms logger recorded in that step. Beside each it writes what the planner predicts from the config dict alone (closed-form count, no live
numbers): moe.model_state_bytes for EP, memory.model_state_bytes for ZeRO-3. The test compares them.

transformers 5.24 + DeepSpeed 0.19.8 need the harness's one registry shim for AutoEP (harness/model/moe/compat.py).
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402

CFG = {"model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
       "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
       "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "tie_word_embeddings": False,
       "output_router_logits": True}
CASES = {"zero2 ep2": (2, 2), "zero3 leaves": (3, 1)}
SEQ, MICRO = 16, 2


def ds_config(stage: int, ep: int) -> dict:
    zo = {"stage": stage, "reduce_bucket_size": 64 * 64, "allgather_bucket_size": 64 * 64, "overlap_comm": True}
    if stage == 3:
        zo.update(stage3_param_persistence_threshold=640, stage3_prefetch_bucket_size=int(0.9 * 64 * 64),
                  leaf_module={"classes": ["Qwen3MoeSparseMoeBlock"]})
    out = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "zero_optimization": zo,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_allow_untested_optimizer": True}
    if ep > 1:
        out["expert_parallel"] = {"enabled": True, "autoep_size": ep, "preset_model": "qwen3_moe",
                                  "use_grouped_mm": False}
        out["comms_logger"] = {"enabled": True, "verbose": False, "prof_all": True}
    return out


def predicted(stage: int, ep: int, zero_shards: int, ds: dict) -> dict:
    from harness.planner import memory, moe
    from harness.planner.params import count_params
    from dataclasses import replace

    from harness.config.run_model import Zero

    count = count_params({k: v for k, v in CFG.items() if k != "output_router_logits"})
    b = Zero.of(ds).buckets
    zero = Zero(stage, buckets=b)
    held = memory.Holding(count.total, max(count.largest_layer, count.moe_block if stage == 3 else 0),
                          count.largest_tensor)
    common = dict(zero_shards=zero_shards, precision="fp32", phase="after_step")
    if ep > 1:
        return moe.model_state_bytes(count, held, zero, ep=ep, **common)
    return memory.model_state_bytes(replace(held, persistent=count.persistent_numel(b.param_persistence_threshold)),
                                    zero, **common)


def run_predicted(engine, ds: dict, world: int) -> dict:
    """What the run's own report predicts (harness.planner.evaluate with the facts read off the live engine:
    profiling/live.py); no model config, so no activations."""
    from harness.config.run_model import Batch, Degrees, RunModel, Sequence, Zero
    from harness.planner import evaluate
    from harness.profiling.live import live_facts

    ep = (ds.get("expert_parallel") or {}).get("autoep_size", 1)
    run = RunModel("qwen3-moe", {}, "fp32", Degrees(world, ep=ep), Zero.of(ds), Batch(MICRO, 1, MICRO * world),
                   Sequence(SEQ))
    return evaluate(run, live=live_facts(engine.module, engine.optimizer)).rank["after_step"]


def all_to_all_logged() -> int:
    """all_to_all_single bytes DeepSpeed's comms logger recorded (each call at its input: what this rank sends),
    less AutoEP's exchange of per-expert token counts (E int64 per sparse block)."""
    from deepspeed.comm import comms_logger

    calls = comms_logger.comms_dict.get("all_to_all_single", {})
    return sum(size * record[0] for size, record in calls.items() if size > 8 * CFG["num_experts"])


def planned_all_to_all(ep: int) -> int:
    from harness.planner import moe
    from harness.planner.params import count_params

    count = count_params({k: v for k, v in CFG.items() if k != "output_router_logits"})
    return moe.all_to_all_bytes(count, CFG["hidden_size"], ep=ep, seq_len=SEQ, micro_batch=MICRO, micro_batches=1,
                                precision="fp32", activation_checkpointing=False)


def main(out_path: str) -> int:
    import deepspeed
    import torch
    import transformers

    from harness import dist as distmod
    from harness.profiling.memory import model_state_bytes

    from harness.model.moe.compat import patch_output_capture_registry

    patch_output_capture_registry()
    distmod.init(10)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    results = {}
    try:
        for name, (stage, ep) in CASES.items():
            torch.manual_seed(1234)
            config = transformers.AutoConfig.for_model(**CFG)
            model = transformers.AutoModelForCausalLM.from_config(config).float()
            ds = ds_config(stage, ep)
            engine, *_ = deepspeed.initialize(model=model, config=ds, model_parameters=model.parameters())
            from deepspeed.comm import comms_logger

            comms_logger.comms_dict.clear()
            ids = torch.randint(0, CFG["vocab_size"], (MICRO, SEQ), generator=torch.Generator().manual_seed(rank))
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            results[name] = {"measured": model_state_bytes(engine), "predicted": predicted(stage, ep, world, ds),
                             "all_to_all": all_to_all_logged(), "all_to_all_planned": planned_all_to_all(ep),
                             "loss": float(loss.detach()), "run_predicted": run_predicted(engine, ds, world),
                             "autoep_layers": sum(type(m).__name__ == "AutoEPMoELayer" for m in engine.module.modules())}
            engine.destroy()
            del engine, model
            distmod.barrier()
    finally:
        distmod.teardown()
    with open(f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    exit_now(main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
