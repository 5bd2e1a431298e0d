"""Muon and bf16 master weights / optimizer states on live DeepSpeed engines, every case in ONE process group:
deepspeed --num_gpus N tests/drivers/optim_engines.py OUT.json [bytes] [muon] [lowbit]

bytes (2 ranks): per combination, a tiny Llama (bf16) trains 2 steps; the model states the engine holds after them
(harness.profiling.memory.model_state_bytes), the dtypes of the live optimizer's states and master copy, and what the
planner predicts from the DeepSpeed dict alone (memory.model_state_bytes, phase after_step); ZeRO-1/2 Muon: the
Newton-Schulz updates the optimizer holds between the end of the last backward and its step (muon_updates), beside
the step phase's share for them.
muon (any world size): the same model in fp32, Muon on ZeRO-1/2/3 without clipping, 3 steps on a fixed global batch
split evenly over the ranks: the losses, and (rank 0) the weights after each step beside a plain-torch Muon +
AdamW written from the published formula (tests/helpers/muon_ref.py) on the whole batch in one process.
lowbit (2 ranks): tests/drivers/lowbit_engines.py's int8-state and fp8 cases (tests/test_lowbit.py), in the same launch.
TORCHDYNAMO_DISABLE=1 (set by the test): DeepSpeed's muon_update is torch.compile'd, minutes of inductor on CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402

CFG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False}
BOTH = {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
# name: (stage, optimizer, bf16 flags, offload_optimizer device or "momentum")
BYTES = {"zero2 adamw": (2, "AdamW", {}, None), "zero2 bf16 states": (2, "AdamW", BOTH, None),
         "zero3 bf16 states": (3, "AdamW", BOTH, None),
         "zero2 bf16 master offload": (2, "AdamW", {"bf16_master_weights_and_grads": True}, "cpu"),
         "zero2 bf16 states offload": (2, "AdamW", BOTH, "cpu"),
         "zero1 muon": (1, "Muon", {}, None), "zero2 muon": (2, "Muon", {}, None), "zero3 muon": (3, "Muon", {}, None),
         "zero3 muon momentum in memory": (3, "Muon", {}, "momentum"),  # save_muon_momentum_buffer_in_memory
         "zero2 muon bf16 states": (2, "Muon", BOTH, None)}
MUON_STAGES = (1, 2, 3)
SEQ, ROWS, STEPS = 16, 4, 3  # ROWS: the global batch, split evenly over the ranks
LR = {"lr": 1e-3, "muon_lr": 0.02, "adam_lr": 1e-3, "momentum": 0.95, "weight_decay": 0.01,
      "betas": [0.9, 0.95], "eps": 1e-8}


def ds_config(stage: int, opt: str, bf16: dict | None, offload: str | None, micro: int) -> dict:
    zo = {"stage": stage, "reduce_bucket_size": 4096, "allgather_bucket_size": 4096, "overlap_comm": True}
    if stage == 3:
        zo.update(stage3_param_persistence_threshold=640, stage3_prefetch_bucket_size=3686)
        if opt == "Muon":
            zo["reduce_scatter"] = False
    if offload == "momentum":  # only NVMe swapping reads it: the momentum is the same one tensor either way
        zo["save_muon_momentum_buffer_in_memory"] = True
    elif offload:
        zo["offload_optimizer"] = {"device": offload}
    params = dict(LR) if opt == "Muon" else {k: LR[k] for k in ("lr", "betas", "eps", "weight_decay")}
    out = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "zero_optimization": zo,
           "optimizer": {"type": opt, "params": params}, "gradient_clipping": 0.0}
    if bf16 is not None:
        out["bf16"] = {"enabled": True, **bf16}
    return out


def model():
    import torch
    import transformers

    torch.manual_seed(1234)
    return transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**CFG)).float()


def batch():
    import torch

    return torch.randint(0, CFG["vocab_size"], (ROWS, SEQ), generator=torch.Generator().manual_seed(7))


def predicted(ds: dict, world: int) -> dict:
    from harness.config.run_model import OptimizerDtypes, Zero
    from harness.planner import memory
    from harness.planner.optimizer import gathers_of, holding
    from harness.planner.params import count_params

    count, zero, dtypes = count_params(CFG), Zero.of(ds), OptimizerDtypes.of(ds)
    # built outside zero.Init: MuonWithAuxAdam's sort by size() orders the Muon matrices, largest first
    held = memory.Holding(count.total, count.largest_layer, count.largest_tensor,
                          persistent=count.persistent_numel(zero.buckets.param_persistence_threshold)
                          if zero.stage == 3 else 0, **holding(dtypes, count.total, count, world),
                          **gathers_of(dtypes, zero.stage, count, world, zero.buckets, "bf16", zero_init=False))
    phases = {phase: memory.model_state_bytes(held, zero, zero_shards=world, precision="bf16", phase=phase)
              for phase in ("after_step", "step")}
    # the step's gradients less those of a rank that holds no Muon matrix whole: Muon's updates
    no_updates = memory.Holding(**{**held.__dict__, "muon_whole": 0})
    without = memory.model_state_bytes(no_updates, zero, zero_shards=world, precision="bf16", phase="step")
    updates = sum(phases["step"]["grads"].values()) - sum(without["grads"].values())
    return {**phases["after_step"], "muon_updates": updates}


@contextlib.contextmanager
def logged_comm(on: bool):
    """{op: bytes} DeepSpeed's comms logger records inside the block (planner/comm.py's logged convention)."""
    from deepspeed.comm import comms_logger

    out: dict = {}
    if on:
        comms_logger.enabled, comms_logger.prof_all, comms_logger.verbose, comms_logger.debug = True, True, False, False
        comms_logger.comms_dict.clear()
    try:
        yield out
    finally:
        if on:
            for op, sizes in comms_logger.comms_dict.items():
                out[op] = sum(int(size) * v[0] for size, v in sizes.items())
            comms_logger.enabled = False
            comms_logger.comms_dict.clear()


def planned_muon_comm(engine, ds: dict, world: int) -> dict:
    """The planner's collectives of a ZeRO-3 Muon step: Muon's own for the engine's Muon sub-groups (profiling.live
    reads them) and ZeRO-3's regather of the persistent parameters after the step (planner/comm.py's term)."""
    from harness.config.run_model import OptimizerDtypes, Zero
    from harness.planner import comm, optimizer
    from harness.planner.params import count_params
    from harness.profiling.live import _muon_groups

    zero = Zero.of(ds)
    persistent = count_params(CFG).persistent_numel(zero.buckets.param_persistence_threshold)
    muon = optimizer.comm(OptimizerDtypes.of(ds), 3, _muon_groups(engine.optimizer), world, zero.buckets, "bf16")
    return comm.merged(muon, {"all_gather_into_tensor": 2 * -(-persistent // world)})


def muon_updates(engine) -> int:
    """Bytes of the Newton-Schulz updates a ZeRO-1/2 Muon optimizer holds after backward (averaged_gradients of
    its Muon groups, each storage once: a straddling matrix's slice is a view of the whole update)."""
    opt = engine.optimizer
    if not hasattr(opt, "averaged_gradients") or not hasattr(opt, "_is_muon_group"):
        return 0
    storages = {}
    for i, tensors in opt.averaged_gradients.items():
        if tensors is not None and opt._is_muon_group(opt.params_in_partition[i]):
            for t in tensors:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def live_dtypes(engine) -> dict:
    import torch

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    states = sorted({f"{k}:{v.dtype}".replace("torch.", "") for s in inner.state.values() for k, v in s.items()
                     if torch.is_tensor(v) and v.numel() > 1})
    master = sorted({str(p.dtype).replace("torch.", "") for g in inner.param_groups for p in g["params"]})
    return {"states": states, "master": master, "optimizer": type(inner).__name__}


def run_bytes(rank: int, world: int) -> dict:
    import deepspeed
    import torch

    from harness.profiling.memory import model_state_bytes

    out = {}
    ids = batch().chunk(world)[rank]
    for name, (stage, opt, flags, offload) in BYTES.items():
        net = model()
        ds = ds_config(stage, opt, flags, offload, ids.shape[0])
        engine, *_ = deepspeed.initialize(model=net, config=ds, model_parameters=net.parameters())
        for _ in range(2):
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            updates = muon_updates(engine)
            with logged_comm(stage == 3 and opt == "Muon") as step_comm:
                engine.step()
        out[name] = {"live": model_state_bytes(engine), "planned": predicted(ds, world), "muon_updates": updates,
                     **live_dtypes(engine)}
        if step_comm:
            out[name]["step_comm"] = step_comm
            out[name]["planned_muon_comm"] = planned_muon_comm(engine, ds, world)
        engine.destroy()
        del engine
        torch.distributed.barrier()
    return out


def full_weights(engine) -> dict:
    import deepspeed

    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=hasattr(next(iter(params.values())),
                                                                                    "ds_id")):
        return {n: p.detach().float().clone() for n, p in params.items()}


def run_muon(rank: int, world: int, out_path: str) -> dict:
    import deepspeed
    import torch

    from helpers.muon_ref import reference_steps

    ids = batch()
    mine = ids.chunk(world)[rank]
    ref = reference_steps(model(), ids, STEPS, LR) if rank == 0 else None
    out = {}
    for stage in MUON_STAGES:
        net = model()
        engine, *_ = deepspeed.initialize(model=net, config=ds_config(stage, "Muon", None, None, mine.shape[0]),
                                          model_parameters=net.parameters())
        losses, diffs = [], []
        for step in range(STEPS):
            loss = engine(input_ids=mine, labels=mine).loss
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(float(mean) / world)
            weights = full_weights(engine)
            if rank == 0:  # largest |deepspeed - reference| over the largest |update| of the step, per tensor kind
                diffs.append(_relative_update_error(weights, ref["weights"][step], ref["weights"][step - 1]
                                                    if step else ref["initial"], ref["muon"]))
        out[f"zero{stage}"] = {"losses": losses, "update_error": diffs,
                               "muon_params": sorted(n for n, p in engine.module.named_parameters() if p.use_muon)}
        if rank == 0:  # the weights after the last step, for the test to hold world sizes side by side
            out[f"zero{stage}"]["reference_losses"] = ref["losses"]
            torch.save({"weights": weights, "initial": ref["initial"]}, f"{out_path}.zero{stage}.pt")
        engine.destroy()
        del engine
        torch.distributed.barrier()
    return out


def _relative_update_error(got: dict, want: dict, before: dict, muon: set) -> dict:
    out = {"muon": 0.0, "adamw": 0.0}
    for name, w in want.items():
        update = (w - before[name]).abs().max().item()
        err = (got[name] - w).abs().max().item() / max(update, 1e-30)
        kind = "muon" if name in muon else "adamw"
        out[kind] = max(out[kind], err)
    return out


def lowbit(rank: int, world: int) -> dict:
    """tests/drivers/lowbit_engines.py's cases (int8 states, fp8 matmuls) in this launch: tests/test_lowbit.py."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import lowbit_engines

    return lowbit_engines.results(rank, world)


def main(out_path: str, parts: list[str]) -> int:
    import torch

    from harness import dist as distmod

    distmod.init(10)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    try:
        results = {"world": world, **({"bytes": run_bytes(rank, world)} if "bytes" in parts else {}),
                   **({"muon": run_muon(rank, world, out_path)} if "muon" in parts else {}),
                   **({"lowbit": lowbit(rank, world)} if "lowbit" in parts else {})}
    finally:
        distmod.teardown()
    Path(f"{out_path}.rank{rank}").write_text(json.dumps(results))  # one file per rank: the test reads both
    return 0


if __name__ == "__main__":
    quick_start()
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    exit_now(main(args[0], args[1:]))
