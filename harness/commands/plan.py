"""`harness plan --model M --gpus N --gpu-mem 80GB`: which strategy fits, what each GPU holds, what
crosses the wire, and the launch command. Pure math: no process group, no weights; answers in well under
a second for known model families.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from harness.config.defaults import PRECISION_BYTES, recipe_default
from harness.config.objectives import OBJECTIVES
from harness.config.run_model import optimizer_states
from harness.commands import plan_objective
from harness.planner import optimizer as optimizer_widths
from harness.errors import UsageError
from harness.planner import teacher
from harness.planner.memory import OFFLOAD_DEVICES

UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
DEFAULT_SEQ_LEN = 2048
HUB_SUFFIXES = ("-hf", "-instruct", "-chat", "-v0.1")  # same shapes as the base model's config


def parse_size(text: str, flag: str) -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2^30; a bare number or 'G' is ambiguous and refused."""
    match = SIZE_RE.match(text or "")
    unit = match.group(2).lower() if match else ""
    if not match or unit not in UNITS:
        raise UsageError(f"{flag} {text!r}: give a size with a unit, e.g. 80GB (10^9 bytes) or 80GiB "
                         f"(2^30 bytes); units: {', '.join(u.upper().replace('I', 'i') for u in UNITS)}")
    nbytes = int(float(match.group(1)) * UNITS[unit])
    if nbytes <= 0:
        raise UsageError(f"{flag} {text!r}: must be more than 0 bytes")
    return nbytes


def hub_alias(spec: str) -> str | None:
    """A hub id whose shape is built in ('meta-llama/Llama-2-7b-hf' -> 'llama-2-7b'), offline."""
    from harness.model_shapes import KNOWN

    name = spec.rsplit("/", 1)[-1].lower().removeprefix("meta-")
    for _ in HUB_SUFFIXES:
        for suffix in HUB_SUFFIXES:
            name = name.removesuffix(suffix)
    return name if name in KNOWN else None


def resolve_model(spec: str) -> dict:
    """Config dict for a preset, known name, local dir / config.json, or hub id (online)."""
    from harness.model_shapes import KNOWN, load_model_config

    try:
        return load_model_config(spec)
    except UsageError:
        if Path(spec).exists() or "/" not in spec:
            raise
    alias = hub_alias(spec)
    if alias:
        return dict(KNOWN[alias])
    try:
        import transformers

        return transformers.AutoConfig.from_pretrained(spec).to_dict()
    except Exception as e:  # offline, gated, or no such repo: one line, not a traceback
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"--model {spec!r}: not built in and its config could not be fetched from the hub "
                         f"({reason}); pass a local config.json or a known name") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="preset, known model (llama-2-7b, ...), local dir or config.json, or hub id")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs per node")
    parser.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    parser.add_argument("--gpu-mem", help="memory per GPU with a unit: 80GB, 80GiB, 24000MB (default: the --hardware "
                                          "profile's)")
    parser.add_argument("--cpu-mem", help="CPU RAM per node (default: not checked)")
    parser.add_argument("--nvme", help="NVMe space per node for ZeRO-Infinity (default: none)")
    parser.add_argument("--seq-len", type=int,
                        help=f"tokens per sequence (default {DEFAULT_SEQ_LEN}, or the model's maximum if shorter); every layout "
                             "reports the longest it holds (max seq), and one no plain layout holds gets the long-context "
                             "rung: checkpointing, tiled MLP and loss, Ulysses sp inside a node, activation offload")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward (default 1)")
    parser.add_argument("--grad-accum", type=int, default=1,
                        help="micro-batches per step (default 1; pipelines use 4 x stages)")
    parser.add_argument("--precision", choices=tuple(PRECISION_BYTES), default=recipe_default("precision"))
    parser.add_argument("--optimizer", choices=_enum("optimizer.type"), default=recipe_default("optimizer.type"),
                        help="the recipe's optimizer.type: its fp32 state per parameter (AdamW, Adam, Lamb 2; Lion, "
                             "Adagrad 1; sgd none; muon: 1 on the hidden matrices, AdamW's 2 on the rest) "
                             "(default %(default)s)")
    parser.add_argument("--master-dtype", choices=_enum("optimizer.master_dtype"),
                        default=recipe_default("optimizer.master_dtype"),
                        help="optimizer.master_dtype: ZeRO's master weights and gradient partitions (bf16: 2 B/param "
                             "instead of 4; docs/optimizers.md)")
    parser.add_argument("--state-dtype", choices=_enum("optimizer.state_dtype"),
                        default=recipe_default("optimizer.state_dtype"),
                        help="optimizer.state_dtype: each optimizer state (bf16: 2 B instead of 4; needs --master-dtype "
                             "bf16). With fp32 states (the default) the decision order offers bf16 ones after ZeRO-2")
    parser.add_argument("--activation-checkpointing", nargs="?", const="full", default="none", choices=("none", "full"),
                        help="full: recompute each block in backward (keeps only block inputs); alone means full")
    parser.add_argument("--attention", choices=("flash", "flex", "sdpa", "eager"), default="flash",
                        help="attention kernel (default flash: no materialised mask); sdpa and eager count transformers' "
                             "(seq/sp)^2 mask per rank, eager its scores too (planner/activations.py)")
    parser.add_argument("--packing", choices=("document", "concat"), default="document",
                        help="how rows are packed (the recipe's train.packing; default document): document rows carry "
                             "position ids, which a pipeline sends between stages")
    parser.add_argument("--global-batch", type=int,
                        help="sequences per optimizer step over all GPUs (default micro-batch x grad-accum x GPUs); "
                             "the search keeps it fixed and picks the micro-batch")
    parser.add_argument("--hardware", help="hardware profile for the step-time model: a name "
                                           "(harness/planner/profiles/) or a JSON file from `harness calibrate` "
                                           "(default: the named GPU profile nearest --gpu-mem)")
    layout = parser.add_argument_group("one exact layout (evaluated instead of searched; any of these selects it)")
    layout.add_argument("--tp", type=int, help="tensor-parallel degree (inside a node)")
    layout.add_argument("--pp", type=int, help="pipeline stages")
    layout.add_argument("--ep", type=int, help="expert-parallel degree (MoE models; DeepSpeed AutoEP)")
    layout.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage")
    layout.add_argument("--offload", choices=OFFLOAD_DEVICES, help="optimizer (ZeRO-3: and parameters) offload")
    parser.add_argument("--scaling", metavar="PNG", help="also draw predicted tokens/s per GPU against node count "
                                                         "for the recommended layout into this PNG")
    parser.add_argument("--lora-r", type=int,
                        help="plan LoRA fine-tuning: rank-R adapters on every attention and MLP projection, base "
                             "frozen (2 B/param in bf16, no gradient or optimizer state)")
    parser.add_argument("--expert-imbalance", type=float,
                        help="MoE: tokens on the busiest expert-parallel rank over the mean (default 1.1, the router's "
                             "balancing loss on); scales the experts' compute and all-to-all of EP layouts")
    pref = parser.add_argument_group("the objective (harness/config/objectives.py); preference optimisation "
                                     "(docs/preference.md)")
    pref.add_argument("--objective", choices=tuple(OBJECTIVES), default=recipe_default("train.objective"),
                      help="dpo / ipo / simpo / orpo: the micro-batch counts pairs (two sequences each) and the "
                           "reference model's bytes and time are counted per mode; grpo, gkd, distill: it counts "
                           "completions of --max-prompt-length + --max-completion-length tokens (default lm)")
    pref.add_argument("--reference-mode", choices=_enum("preference.reference_mode"),
                      default=recipe_default("preference.reference_mode"),
                      help="the reference to count (default auto: the planner's recommendation per layout)")
    pref.add_argument("--pairs", type=int, help="pairs in the preference set (precomputed: its host table and its "
                                                "one pass up front)")
    pref.add_argument("--steps", type=int, help="optimizer steps the run trains (the recommendation weighs a pass "
                                                "over every pair against a reference forward per step; with "
                                                "--datasets: each source's epochs)")
    data = parser.add_argument_group("a mixture (train.datasets; docs/data.md)")
    data.add_argument("--datasets", help="the train.datasets JSON list: each source's rows and tokens from its store "
                                         "where one exists, its epochs over --steps and the steps to one epoch of the "
                                         "source that runs out first (rows per step: --global-batch, else micro-batch "
                                         "x grad-accum x GPUs)")
    data.add_argument("--store-dir", default="", help="where the token stores are (train.store_dir)")
    rl = parser.add_argument_group("online RL, --objective grpo (docs/rl.md): the generation's memory and time")
    rl.add_argument("--num-generations", type=int, default=8, help="completions per prompt (rl.num_generations)")
    rl.add_argument("--max-completion-length", type=int,
                    help="tokens per completion (default: the objective's: rl.max_completion_length for grpo, TRL's "
                         "max_new_tokens 128 for gkd, max_completion_length 512 for distill)")
    rl.add_argument("--max-prompt-length", type=int, help="tokens per prompt (default rl.max_prompt_length, %s)"
                                                          % recipe_default("rl.max_prompt_length"))
    rl.add_argument("--generator", choices=("hf", "vllm"), default="hf",
                    help="rl.generator; gkd, distill: vllm is distill.use_vllm (the student's on-policy completions)")
    rl.add_argument("--vllm-gpu-memory-utilization", type=float, metavar="F",
                    help="vllm: the share of the GPU the colocated vLLM may take (rl.vllm_gpu_memory_utilization, "
                         "distill.vllm_gpu_memory_utilization; default %s)" % recipe_default("rl.vllm_gpu_memory_utilization"))
    rl.add_argument("--gather-mb", type=float, help="rl.gather_mb (default: the planner chooses)")
    rl.add_argument("--sync-bucket-mb", type=float, default=256.0, help="rl.sync_bucket_mb (vllm)")
    rl.add_argument("--beta", type=float, help="grpo: rl.beta (default %s: TRL loads no reference); gkd, distill: "
                                               "the generalised JSD's beta (a served teacher refuses beta > 0 with "
                                               "--loss-top-k > 1)" % recipe_default("rl.beta"))
    rl.add_argument("--async", dest="rl_async", action="store_true", help="rl.async: price the generator "
                    "processes (a weights copy and KV cache each) and the overlapped step (max(generate, train))")
    rl.add_argument("--max-staleness", type=int, default=recipe_default("rl.max_staleness"),
                    help="rl.max_staleness under --async (default %(default)s; 0: no overlap)")
    rl.add_argument("--async-generator-device", choices=_enum("rl.async_generator_device"),
                    default=recipe_default("rl.async_generator_device"), help="rl.async_generator_device under "
                    "--async: auto (the plan's GPUs) and cuda count the generator's weights and KV cache per GPU, in "
                    "the fit beside training; cpu in host memory (default %(default)s)")
    rl.add_argument("--max-tool-calling-iterations", type=int, default=0, help="multi-turn rollouts: rounds of "
                    "tool calls (rl.max_tool_calling_iterations); each is one more generate call re-prefilling the "
                    "prompt and the turns so far (default 0: single-turn)")
    rl.add_argument("--tool-result-tokens", type=int, default=0, help="multi-turn: tokens one round of tool "
                    "results adds (rl.max_tool_result_tokens + the template's tool message wrapping); they count in "
                    "--max-completion-length and are prefilled, not decoded (default 0)")
    kd = parser.add_argument_group("distillation, --objective gkd | distill (docs/planner.md): the teacher")
    kd.add_argument("--teacher", help="the teacher model (preset, known name, local dir or config.json, hub id; "
                                      "default: the student's own model)")
    kd.add_argument("--teacher-mode", choices=("auto",) + teacher.MODES, default="auto",
                    help="the teacher to count (default auto: the planner's recommendation per layout)")
    kd.add_argument("--loss-top-k", type=int, default=1,
                    help="top-k log-probs per token of a precomputed or served teacher (default 1, TRL's loss_top_k)")
    kd.add_argument("--lmbda", type=float, help="gkd: the share of micro-batches the student generates (on-policy, "
                                                "priced as grpo's generation; default: TRL's 0.5); distill is "
                                                "always on-policy")
    kd.add_argument("--records", type=int, help="records in the prompt-completion set (the precomputed store's "
                                                "size and its pass up front)")
    vl = parser.add_argument_group("vision-language models (docs/vision-language.md)")
    vl.add_argument("--images-per-sample", type=int, default=1,
                    help="images in one sample (default 1): their tokens, the vision tower's activations")
    vl.add_argument("--image-size", default="448x448", metavar="HxW",
                    help="image resolution as the processor sees it (default 448x448)")
    vl.add_argument("--freeze", default="", metavar="PARTS",
                    help="vision.freeze, comma-separated (vision, projector, language): a frozen tower keeps no "
                         "activations for backward")
    vl.add_argument("--max-images-per-call", type=int, default=recipe_default("vision.max_images_per_call"),
                    help="vision.max_images_per_call: images per vision-tower call (bounds one call's working "
                         "memory; default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")


def _enum(dotted: str) -> tuple[str, ...]:
    from harness.config.schema import RECIPE_SCHEMA, subschema

    return tuple(subschema(RECIPE_SCHEMA, dotted)["enum"])


def lora_count(cfg: dict, lora_r: int | None):
    """The parameter count with rank-r adapters (None: full fine-tuning, the planner counts itself)."""
    if not lora_r:
        return None
    from harness.planner.params import count_params, with_lora

    return with_lora(count_params(cfg), cfg, lora_r)


def run(args: argparse.Namespace) -> int:
    """Print the plan; exit 0 with a recommendation, 1 when nothing fits (the output says what is missing)."""
    from harness.planner import plan
    from harness.planner.inputs import Cluster, Workload
    from harness.planner.render import to_json, to_text

    from harness.planner import hardware

    profile = hardware.load(args.hardware) if args.hardware else None
    if args.gpu_mem is None and profile is None:
        raise UsageError("--gpu-mem is required without --hardware: give the memory per GPU (e.g. --gpu-mem 80GB) "
                         f"or a profile ({', '.join(hardware.names())})")
    gpu_mem = parse_size(args.gpu_mem, "--gpu-mem") if args.gpu_mem else profile["gpu_mem_bytes"]
    profile = profile or hardware.for_memory(gpu_mem)
    cpu_mem = parse_size(args.cpu_mem, "--cpu-mem") if args.cpu_mem is not None else None
    nvme = parse_size(args.nvme, "--nvme") if args.nvme is not None else None
    for flag, value in (("--gpus", args.gpus), ("--nodes", args.nodes), ("--seq-len", args.seq_len),
                        ("--micro-batch", args.micro_batch), ("--grad-accum", args.grad_accum),
                        ("--global-batch", args.global_batch), ("--tp", args.tp), ("--pp", args.pp),
                        ("--lora-r", args.lora_r), ("--ep", args.ep), ("--pairs", args.pairs),
                        ("--steps", args.steps)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
    cfg = resolve_model(args.model)
    seq_len = plan_objective.seq_len(args, min(DEFAULT_SEQ_LEN, cfg.get("max_position_embeddings",
                                                                         cfg.get("n_positions")) or DEFAULT_SEQ_LEN))
    images = _images(args) if cfg.get("vision_config") else None
    try:
        cluster = Cluster(args.gpus, gpu_mem, args.nodes, cpu_mem, nvme)
        work = Workload(seq_len, args.micro_batch, args.precision, args.activation_checkpointing == "full",
                        args.grad_accum, args.attention, expert_imbalance=args.expert_imbalance, packing=args.packing,
                        global_batch=args.global_batch,
                        optimizer_states=optimizer_states({"optimizer": {"type": args.optimizer}}),
                        optimizer_dtypes=optimizer_widths.from_flags(args.optimizer, args.master_dtype,
                                                                     args.state_dtype, args.precision),
                        vision=_vision_load(cfg, args, images), **plan_objective.objective_work(args, cfg, resolve_model))
        result = plan(cfg, cluster, work, model_name=args.model, count=lora_count(cfg, args.lora_r),
                      hardware_profile=profile, layout=_layout(args))
    except ValueError as e:
        raise UsageError(f"plan: {e}") from None
    if not args.hardware:
        result.notes.append(f"hardware profile not given: timed on {profile['name']} (the named profile nearest "
                            f"{args.gpu_mem} per GPU; --hardware NAME|FILE to choose)")
    if args.scaling and result.recommended:
        from harness.planner.scaling import curve
        from harness.report.scaling_plot import draw

        result.scaling = curve(result, cfg, profile)
        result.scaling["png"] = draw(result.scaling, args.scaling)
    if args.lora_r and not args.json:
        count = result.model["params"]
        sys.stdout.write(f"LoRA r={args.lora_r}: {count['lora_per_layer'] * count['num_layers']:,} trainable / "
                         f"{count['total'] - count['lora_per_layer'] * count['num_layers']:,} frozen parameters "
                         "(frozen: 16-bit weights only; gradients, fp32 master and Adam for the adapters)\n")
    if images:
        _vision_lines(args, cfg, seq_len, result, images)
    mixture = mixture_plan(args, seq_len) if args.datasets else None
    rollouts = plan_objective.rollout_section(args, cfg, result, gpu_mem, profile) \
        if plan_objective.generates(args, work) else None
    if args.json:
        extra = {**({"data": mixture[1]} if mixture else {}), **({"rollouts": rollouts} if rollouts else {})}
        text = to_json(result)
        sys.stdout.write((json.dumps({**json.loads(text), **extra}, indent=2) if extra else text) + "\n")
    else:
        sys.stdout.write(to_text(result) + (plan_objective.render_rollouts(rollouts) if rollouts else "")
                         + ("\n".join(mixture[0]) + "\n" if mixture else ""))
    return 0 if result.recommended or result.evaluated else 1


def tokenizer_or_none(model: str):
    """The model's tokenizer, or None where it cannot be had here (a hub model offline): the stores are then unknown."""
    from harness.model.hf import load_tokenizer

    try:
        return load_tokenizer(model)
    except Exception:  # any failure to find or read it means the same: the counts are not known here
        return None


def mixture_plan(args: argparse.Namespace, seq_len: int) -> tuple[list[str], dict]:
    """(lines, JSON) of a mixture's sources from their stores (harness/data/mixture.plan_lines)."""
    import json

    from harness.config.recipes import complete
    from harness.data.mixture import plan_lines

    try:
        datasets = json.loads(args.datasets)
    except ValueError as e:
        raise UsageError(f"--datasets: not JSON ({e}); give the train.datasets list, e.g. "
                         '\'[{"dataset": "a.jsonl", "weight": 0.7}, {"dataset": "b.jsonl", "weight": 0.3}]\'') from None
    overrides = [f"train.model={args.model}", f"train.seq_len={seq_len}", f"train.store_dir={args.store_dir}",
                 f"train.datasets={json.dumps(datasets)}"]
    train = complete({"description": "plan"}, "harness plan --datasets", overrides)["train"]
    global_batch = args.global_batch or args.micro_batch * args.grad_accum * args.gpus * args.nodes
    return plan_lines(train, global_batch, args.steps, tokenizer_or_none(args.model))


def _images(args: argparse.Namespace) -> tuple[int, int, tuple[str, ...]]:
    """(height, width, frozen parts) of --image-size and --freeze, checked."""
    from harness.planner.vision import PARTS

    try:
        height, width = (int(v) for v in args.image_size.lower().split("x"))
    except ValueError:
        raise UsageError(f"--image-size {args.image_size!r}: give HEIGHTxWIDTH in pixels, e.g. 448x448") from None
    if min(height, width, args.images_per_sample, args.max_images_per_call) < 1:
        raise UsageError("--image-size, --images-per-sample and --max-images-per-call must be at least 1")
    freeze = tuple(p.strip() for p in args.freeze.split(",") if p.strip())
    unknown = [p for p in freeze if p not in PARTS]
    if unknown:
        raise UsageError(f"--freeze {args.freeze!r}: {', '.join(unknown)} is not a part; parts: {', '.join(PARTS)}")
    return height, width, freeze


def _vision_load(cfg: dict, args: argparse.Namespace, images):
    """The workload's vision term (planner/vision.VisionLoad): every layout's activations count it."""
    if images is None:
        return None
    from harness.planner.vision import vision_load

    height, width, freeze = images
    return vision_load(cfg, args.images_per_sample, height, width, freeze, args.max_images_per_call)


def _vision_lines(args: argparse.Namespace, cfg: dict, seq_len: int, result, images) -> None:
    """The vision tower's and projector's parameters, the image tokens, their activations, what freezing saves
    (planner/vision.py)."""
    from harness.planner import vision

    height, width, freeze = images
    info = vision.summary(cfg, images=args.images_per_sample, height=height, width=width, seq_len=seq_len,
                          micro_batch=args.micro_batch, optimizer_states=optimizer_states(
                              {"optimizer": {"type": args.optimizer}}), zero_shards=args.gpus * args.nodes,
                          precision_bytes=PRECISION_BYTES[args.precision], freeze=freeze,
                          per_call=args.max_images_per_call, checkpointing=args.activation_checkpointing == "full")
    result.model["vision"] = info
    if not args.json:
        sys.stdout.write(vision.render(info, args.images_per_sample, height, width))


def _layout(args: argparse.Namespace) -> dict | None:
    """{zero, offload, tp, pp} when any layout flag is given (the rest default to 1 / ZeRO-0 / none)."""
    if all(getattr(args, k) is None for k in ("tp", "pp", "zero", "offload", "ep")):
        return None
    return {"tp": args.tp or 1, "pp": args.pp or 1, "zero": args.zero or 0, "offload": args.offload or "none",
            "ep": args.ep or 1}
