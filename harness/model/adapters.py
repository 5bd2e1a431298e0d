"""LoRA adapters (peft) on the model a rank trains: one call at each build site, after the model, stage or shard
exists and before deepspeed.initialize.

    apply(model, recipe, ...)   peft's LoRA layers injected in place (the HF module tree and names are kept; each
                                target becomes <name>.base_layer + <name>.lora_A/B.default), base frozen
    attach(target, spec, ...)   (model/lora_attach.py) the one call at each build site: peft's layers, or the harness's
                                own column/row-parallel LoRA (parallel/tensor_lora.py, tp and 3d) split the Megatron way
    param_groups(module, ...)   the trainable parameters only (LoRA+: B in a group of its own)

Initialisation does not depend on the order modules are built or wrapped: every adapter's A is drawn from a
generator seeded by (train.seed, the module's HF name) and B is zero, so a ZeRO-3 build, a pipeline stage, a
tensor-parallel shard and the single-process reference all start from the same adapters.
"""

from __future__ import annotations

import math
import zlib

import torch

from harness.config.adapter_rules import lora_on

ADAPTER = "default"  # peft's adapter name: state-dict keys <module>.lora_A.default.weight
PEFT_PREFIX = "base_model.model."  # what PeftModel.save_pretrained puts before the HF names


def scaling(adapter: dict) -> float:
    r = adapter["r"]
    return adapter["alpha"] / (math.sqrt(r) if adapter["use_rslora"] else r)


HEADS = ("classifier", "score")  # a sequence-classification model's head: peft's SEQ_CLS task trains it in full


def head_modules(model) -> tuple[str, ...]:
    """The score head of a sequence-classification model (train.objective reward), which LoRA trains in full as a
    module to save, as peft's get_peft_model(task_type="SEQ_CLS") does: a random head behind frozen layers would
    otherwise never learn, and the export would have no trained head. () for a causal LM."""
    if not type(model).__name__.endswith("ForSequenceClassification"):
        return ()
    return tuple(n for n in HEADS if isinstance(getattr(model, n, None), torch.nn.Module))


def lora_config(adapter: dict, model_type: str, base: str = "", exclude: str | None = None,
                targets: list[str] | None = None, head: tuple = ()):
    """peft.LoraConfig for the recipe's adapter block (also what adapter_config.json holds). targets: the module
    names that get adapters, where the harness chose them (a vision-language model's vision.lora parts); head: a
    sequence-classification model's head_modules."""
    from peft import LoraConfig

    to_save = list(adapter["modules_to_save"]) + (router_modules(model_type) if adapter.get("train_router") else [])
    to_save += [n for n in head if n not in to_save]
    return LoraConfig(r=adapter["r"], lora_alpha=adapter["alpha"], lora_dropout=adapter["dropout"],
                      target_modules=list(adapter["target_modules"] if targets is None else targets),
                      target_parameters=list(adapter.get("target_parameters", [])) or None,
                      modules_to_save=to_save or None, use_rslora=adapter["use_rslora"],
                      use_dora=adapter["use_dora"], fan_in_fan_out=model_type == "gpt2",  # GPT-2's Conv1D
                      task_type="SEQ_CLS" if head else "CAUSAL_LM", base_model_name_or_path=base or None, bias="none",
                      exclude_modules=exclude)  # a vision-language model's tower (planner/vision.lora_exclude)


ROUTERS = {"gpt_oss": "mlp.router"}  # an MoE layer's router module, by model_type; the others: mlp.gate


def router_modules(model_type: str) -> list[str]:
    """adapter.train_router: the routers, trained in full as modules to save (peft matches the name suffix)."""
    return [ROUTERS.get(model_type, "mlp.gate")]


def _generator(seed: int, name: str) -> torch.Generator:
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))


def init_a(seed: int, name: str, r: int, in_features: int) -> torch.Tensor:
    """A module's whole A (r x in_features): peft's kaiming-uniform init, from a generator of its own."""
    out = torch.empty(r, in_features)
    torch.nn.init.kaiming_uniform_(out, a=math.sqrt(5), generator=_generator(seed, name))
    return out


@torch.no_grad()
def _init_peft_layers(model, seed: int, hf_model=None) -> None:
    from peft.tuners.lora import LoraLayer

    hf_names = {id(m): n for n, m in (hf_model if hf_model is not None else model).named_modules()}
    for name, module in model.named_modules():
        name = hf_names.get(id(module), name)  # a pipeline stage's module, by its name in the whole model
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
            a.copy_(init_a(seed, name, a.shape[0], a.shape[1]).to(a.dtype))
            b.zero_()


def apply(model, recipe: dict, *, seed: int | None = None, hf_model=None):
    """Inject peft LoRA layers into an HF causal LM, or a pipeline stage holding its modules (hf_model: the whole
    model, which names them), in place; only the adapters (and modules_to_save) stay trainable. Returns model."""
    from peft import inject_adapter_in_model

    from harness.model import vision
    from harness.planner.vision import lora_exclude

    adapter, hf_model = recipe["adapter"], model if hf_model is None else hf_model
    seed = recipe["train"]["seed"] if seed is None else seed
    targets = vision.lora_targets(hf_model, adapter["target_modules"], recipe["vision"]["lora"]) \
        if vision.is_vision_language(hf_model.config) else None  # the parts vision.lora names
    config = lora_config(adapter, hf_model.config.model_type, exclude=lora_exclude(hf_model.config), targets=targets,
                         head=head_modules(hf_model))
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    _init_peft_layers(model, seed, hf_model)
    for name, param in model.named_parameters():
        param.requires_grad_(is_trainable_name(name))
    if recipe["activation_checkpointing"] and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # recomputed HF blocks need an input that requires grad
    return model


def is_trainable_name(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_magnitude_vector." in name or ".modules_to_save." in name


def is_b(name: str) -> bool:
    return ".lora_B." in name


def param_groups(module, recipe: dict) -> list:
    """What deepspeed.initialize gets as model_parameters: trainable tensors only, so fp32 masters, Adam state and
    gradient partitions exist for them alone. LoRA+ (adapter.lr_B_ratio): [A and the rest, B at lr x ratio], the
    order the builder's per-group warmup_max_lr assumes."""
    trainable = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    ratio = recipe.get("adapter", {}).get("lr_B_ratio") if lora_on(recipe) else None
    if not ratio:
        return [p for _, p in trainable]
    lr = recipe["optimizer"]["lr"]
    return [{"params": [p for n, p in trainable if not is_b(n)], "lr": lr},
            {"params": [p for n, p in trainable if is_b(n)], "lr": lr * ratio}]


def counts(module) -> tuple[int, int]:
    """(trainable, frozen) parameter elements of a module (ZeRO-3 partitions counted whole)."""
    trainable = frozen = 0
    for p in module.parameters():
        n = getattr(p, "ds_numel", p.numel())
        trainable, frozen = (trainable + n, frozen) if p.requires_grad else (trainable, frozen + n)
    return trainable, frozen


def peft_key(hf_name: str) -> str:
    """A training state-dict key -> its key in adapter_model.safetensors (get_peft_model_state_dict's format, what
    PeftModel.from_pretrained loads): the adapter name dropped, DoRA's magnitude without .weight, a module to save
    under its own name."""
    key = hf_name.replace(f".lora_magnitude_vector.{ADAPTER}.weight", ".lora_magnitude_vector")
    key = key.replace(f".modules_to_save.{ADAPTER}.", ".").replace(f".{ADAPTER}.", ".")
    return PEFT_PREFIX + key


def quantization_config(recipe: dict):
    """QLoRA: bitsandbytes NF4 for the frozen base (CUDA). Under ZeRO-3 the 4-bit storage dtype is the compute
    dtype, so ZeRO can partition and gather the packed weights like any other tensor of that dtype."""
    from transformers import BitsAndBytesConfig

    compute = torch.bfloat16 if recipe["precision"] == "bf16" else torch.float16
    storage = compute if recipe["zero"]["stage"] == 3 else torch.uint8
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute, bnb_4bit_quant_storage=storage)


def build_kwargs(recipe: dict) -> dict:
    """Extra build_model arguments for the adapter: QLoRA's 4-bit quantization of the frozen base."""
    if lora_on(recipe) and recipe["adapter"]["load_in_4bit"]:
        return {"quantization_config": quantization_config(recipe)}
    return {}
