"""Rules for fewer bytes per parameter: Muon, bf16 master weights / optimizer states (optimizer.type muon,
optimizer.master_dtype, optimizer.state_dtype; DeepSpeed's optimizer.type Muon, bf16.bf16_master_weights_and_grads,
bf16.bf16_optimizer_states) and stochastic rounding of the bf16 master copy (optimizer.stochastic_rounding: torchao's
_AdamW as DeepSpeed's client optimizer, harness/train/stochastic_round.py). Each refusal is what DeepSpeed 0.19.8
asserts later (runtime/config.py _do_error_check, base_optimizer._configure_master_weights, zero/stage3.py), or a path
the harness neither tests nor prices. Pure: reads the DeepSpeed dict (and the recipe for LoRA+) only.
"""

from __future__ import annotations

from harness.errors import Problem
from harness.config.resolve import Context

MASTER, STATES = "bf16.bf16_master_weights_and_grads", "bf16.bf16_optimizer_states"
# Optimizers whose bf16 master/state path ran here on live engines (tests/test_optimizers.py): DeepSpeed builds
# FusedAdam (CPUAdam under offload) for Adam/AdamW and MuonWithAuxAdam for Muon; the others' bf16 states are untried.
BF16_STATE_OPTIMIZERS = ("adam", "adamw", "muon")
CPU_ADAM = ("adam", "adamw")  # what DeepSpeed's bf16 master + offload check demands (DeepSpeedCPUAdam)
# Why optimizer.state_dtype int8 is refused, measured (docs/optimizers.md "8-bit states"): torchao 0.18's AdamW8bit as
# DeepSpeed 0.19.8's client optimizer on 2 CPU ranks, ZeRO-2, bf16. It runs, but it steps ZeRO's one flat fp32
# partition per rank and quantizes a state only when that tensor has >= 4096 elements and a multiple of 256 (its
# block): a 33,088-parameter model (16,544 per rank) kept both moments in fp32, a 32,768-parameter one (16,384) got
# 8-bit moments. DeepSpeed pads a partition to 2 elements, not 256, so the bytes saved would hang on the parameter
# count; the GPU path is the same flat partition.
INT8_STATES_REASON = ("8-bit optimizer states (torchao AdamW8bit as DeepSpeed's client optimizer) silently stay "
                      "fp32 under ZeRO: ZeRO hands the optimizer one flat partition per rank, torchao quantizes a "
                      "state only when its length is a multiple of 256, and DeepSpeed pads partitions to 2 "
                      "(measured: 16,544 elements per rank kept fp32 moments, 16,384 got 8-bit ones)")
INT8_STATES_FIX = "use optimizer.master_dtype=bf16 and optimizer.state_dtype=bf16 (4 B/param less than fp32 moments)"


def _flags(ds: dict) -> tuple[bool, bool]:
    bf16 = ds.get("bf16") if isinstance(ds.get("bf16"), dict) else {}
    return bf16.get("bf16_master_weights_and_grads") is True, bf16.get("bf16_optimizer_states") is True


def _zero(ds: dict) -> tuple[int, str]:
    zo = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    stage = zo.get("stage", 0) if isinstance(zo.get("stage", 0), int) else 0
    off = zo.get("offload_optimizer")
    device = off.get("device", "none") if isinstance(off, dict) else "none"
    return stage, device if stage >= 1 else "none"


def _optimizer(ds: dict) -> str:
    opt = ds.get("optimizer") if isinstance(ds.get("optimizer"), dict) else {}
    return str(opt.get("type", "")).lower()


def check_low_precision_states(ds: dict, ctx: Context) -> list[Problem]:
    master, states = _flags(ds)
    if not (master or states):
        return []
    stage, offload = _zero(ds)
    name = _optimizer(ds)
    bf16_on = isinstance(ds.get("bf16"), dict) and ds["bf16"].get("enabled") is True
    path = MASTER if master else STATES
    out = []
    if not bf16_on:
        out.append(Problem(path, "bf16 master weights / optimizer states with a training precision other than bf16: "
                           "they are copies of bf16 weights and gradients", "set precision bf16, or "
                           "optimizer.master_dtype=fp32 and optimizer.state_dtype=fp32"))
    if stage == 0:
        out.append(Problem(path, "bf16 master weights / optimizer states with ZeRO stage 0: DeepSpeed asserts "
                           "'only supported with ZeRO Stage 1, 2, or 3' (the master copy is ZeRO's partition)",
                           "use zero.stage 1 or 2 (the states stay on the device) or 3"))
    if states and not master:
        out.append(Problem(STATES, "bf16 optimizer states with fp32 master weights: DeepSpeed asserts "
                           "'bf16_optimizer_states requires bf16_master_weights_and_grads' (the states take the "
                           "master copy's dtype)", "set optimizer.master_dtype=bf16 too, or state_dtype=fp32"))
    if master and not states and offload == "none" and stage:
        out.append(Problem(MASTER, "bf16 master weights with fp32 optimizer states on the device: DeepSpeed asserts "
                           "'Master weights feature requires ZeRO Offload with DeepSpeedCPUAdam' (only CPU Adam "
                           "steps bf16 weights with fp32 moments)", "set optimizer.state_dtype=bf16 (4 B/param "
                           "less than fp32 moments), or zero.offload_optimizer=cpu"))
    if master and offload != "none" and name and name not in CPU_ADAM:
        out.append(Problem("optimizer.type", f"bf16 master weights with offload_optimizer {offload!r} and optimizer "
                           f"{name!r}: DeepSpeed demands DeepSpeedCPUAdam there", "use optimizer adamw, or no offload"))
    elif master and name and name not in BF16_STATE_OPTIMIZERS:
        out.append(Problem("optimizer.type", f"bf16 master weights / states with optimizer {name!r}: the harness "
                           f"has run and priced them with {', '.join(BF16_STATE_OPTIMIZERS)} only",
                           "use optimizer adamw or muon, or fp32 master_dtype and state_dtype"))
    return out


def check_int8_states(ds: dict, ctx: Context) -> list[Problem]:
    if ctx.recipe.get("optimizer", {}).get("state_dtype") != "int8":
        return []
    return [Problem("optimizer.state_dtype", INT8_STATES_REASON, INT8_STATES_FIX)]


def check_muon(ds: dict, ctx: Context) -> list[Problem]:
    if _optimizer(ds) != "muon":
        return []
    stage, offload = _zero(ds)
    zo = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    out = []
    if stage == 0:
        out.append(Problem("zero_optimization.stage", "Muon with ZeRO stage 0: DeepSpeed's bf16 wrapper takes Muon "
                           "only with fp32 accumulation and dense data parallel, and the harness tests and prices "
                           "Muon on ZeRO 1-3", "use zero.stage 1, 2 or 3"))
    if offload != "none":
        out.append(Problem("zero_optimization.offload_optimizer", f"Muon with offload_optimizer {offload!r}: "
                           "DeepSpeed 0.19.8 runs it through a separate path that gathers each whole Muon matrix "
                           "and its fp32 momentum on the CPU (measured: 19 bytes per parameter of buffers on a tiny "
                           "Llama), which the planner does not price and the harness does not test",
                           "use Muon without offload (ZeRO-2 or 3), or optimizer adamw with offload"))
    if stage == 3 and zo.get("reduce_scatter", True) is not False:
        out.append(Problem("zero_optimization.reduce_scatter", "Muon with ZeRO-3 and reduce_scatter on: DeepSpeed "
                           "raises 'Muon and reduce scatter cannot be used together' (Muon needs whole gradients)",
                           "set zero_optimization.reduce_scatter false (the harness's builder does)"))
    adapter = ctx.recipe.get("adapter", {})
    if adapter.get("type") == "lora" and adapter.get("lr_B_ratio"):
        out.append(Problem("adapter.lr_B_ratio", "LoRA+ with Muon: DeepSpeed regroups the parameters into a Muon "
                           "and an AdamW half, so the B matrices' own lr group does not survive",
                           "drop adapter.lr_B_ratio, or use optimizer adamw"))
    return out


SR = "optimizer.stochastic_rounding"


def check_stochastic_rounding(ds: dict, ctx: Context) -> list[Problem]:
    """torchao 0.18's _AdamW(bf16_stochastic_round=True) rounds stochastically only where the parameter it steps is
    bf16 (its states take the parameter's dtype): under DeepSpeed that is ZeRO's bf16 master partition (ZeRO-1, 2 and
    3, tested). Paths the harness has not run with a client optimizer are refused, not guessed."""
    if ctx.recipe.get("optimizer", {}).get("stochastic_rounding") is not True:
        return []
    master, states = _flags(ds)
    stage, offload = _zero(ds)
    name, out = _optimizer(ds), []
    if name != "adamw":
        out.append(Problem(SR, f"stochastic rounding with optimizer {name!r}: it is torchao's _AdamW "
                           "(bf16_stochastic_round=True) stepping in DeepSpeed's place, an AdamW only",
                           "use optimizer.type adamw, or optimizer.stochastic_rounding false"))
    if not (master and states):
        out.append(Problem(SR, "stochastic rounding without bf16 master weights and states: torchao rounds only into "
                           "a bf16 parameter, and under ZeRO the parameter it steps is the master partition (fp32 "
                           "master weights would round nothing)", "set optimizer.master_dtype=bf16 and "
                           "optimizer.state_dtype=bf16 (recipe zero2_bf16_sr)"))
    zo = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    param_off = zo["offload_param"].get("device", "none") if isinstance(zo.get("offload_param"), dict) else "none"
    if offload != "none" or param_off != "none":
        out.append(Problem(SR, f"stochastic rounding with offload (optimizer {offload!r}, parameters {param_off!r}): "
                           "DeepSpeed's bf16 master weights under optimizer offload demand DeepSpeedCPUAdam, not a "
                           "client optimizer, and the harness has not run torchao's with parameter offload",
                           "drop zero.offload_optimizer and zero.offload_param, or "
                           "optimizer.stochastic_rounding false"))
    if ds.get("pipeline"):
        out.append(Problem(SR, "stochastic rounding with pipeline parallelism: the harness has run torchao's client "
                           "optimizer on ZeRO-1, 2 and 3 engines, not on DeepSpeed's PipelineEngine",
                           "drop parallel.pipeline (ZeRO-1, 2 and 3 take it), or optimizer.stochastic_rounding false"))
    return out
