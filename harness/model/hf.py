"""Model and tokenizer loading: one place that turns a model spec into HF objects.

A spec is a built-in preset name (harness.model_shapes.PRESETS), a local model directory, or a hub id.
Presets get random weights from a seed and the shipped byte-level BPE tokenizer, so they need no network.

Why the care about initialisation: the correctness standard compares a multi-rank DeepSpeed run with a
single-process PyTorch run, so a preset built with the same seed must have the same weights whether or not
ZeRO-3 partitions it at construction time. `build_model` therefore re-runs HF weight init from a fresh
seed after construction on both paths (see `_init_preset_weights`).

ZeRO-3 and transformers: transformers builds a model under `deepspeed.zero.Init` (and loads checkpoints
shard by shard into partitioned parameters) only when its global "HF DeepSpeed config" is set. Its
`HfDeepSpeedConfig` requires `accelerate`, which this project does not depend on, so `_zero3_context`
registers a minimal stand-in through the public `transformers.integrations.set_hf_deepspeed_config` and
keeps it alive after the build (transformers holds only a weakref, and generate() and
resize_token_embeddings() consult it later), until a build_model call without zero3_init_config removes it.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from harness import model_shapes
from harness.errors import UsageError

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
EOS_TOKEN = "<|endoftext|>"
ATTN_IMPLEMENTATION = "sdpa"  # one choice everywhere: parity tests compare runs built by this module

# transformers keeps only a weakref to the registered DeepSpeed config; this strong ref keeps it alive.
_ZERO3_CONFIG_KEEPALIVE: list = []

_HUB_FIX = (
    "it is not a built-in preset ({presets}) nor a local directory, so it was looked up on the Hugging Face "
    "Hub and that failed ({err}).{offline}\n    fix: use a preset or a local model directory, or check the "
    "id and, with network, unset HF_HUB_OFFLINE; offline, the files must already be in the HF cache"
)


def _presets() -> str:
    return ", ".join(sorted(model_shapes.PRESETS))


def _hub_error(what: str, spec: str, err: Exception) -> UsageError:
    from huggingface_hub import constants

    offline = " Offline mode is on (HF_HUB_OFFLINE=1): nothing is downloaded." if constants.HF_HUB_OFFLINE else ""
    first_line = str(err).splitlines()[0] if str(err) else ""
    msg = _HUB_FIX.format(presets=_presets(), err=f"{type(err).__name__}: {first_line}", offline=offline)
    return UsageError(f"cannot load {what} {spec!r}: {msg}")


def _local_error(what: str, folder: str, err: Exception, needs: str, writer: str) -> UsageError:
    first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
    return UsageError(f"cannot load {what} from directory {folder}: {first_line}\n"
                      f"    fix: the directory needs {needs} (write them with {writer}(dir))")


def _shipped_eos_id() -> int:
    """Id of the eos token in the shipped tokenizer.json, read without building a tokenizer."""
    added = json.loads((ASSETS_DIR / "tokenizer.json").read_text())["added_tokens"]
    return next(t["id"] for t in added if t["content"] == EOS_TOKEN)


def load_tokenizer(spec: str):
    """Tokenizer for a model spec; always has a pad token (falls back to eos) so batches can be padded."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if model_shapes.is_preset(spec):
        tok = PreTrainedTokenizerFast(tokenizer_file=str(ASSETS_DIR / "tokenizer.json"),
                                      eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                      unk_token=EOS_TOKEN)
    elif Path(spec).is_dir():
        try:
            tok = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as err:
            raise _local_error("tokenizer", spec, err, "tokenizer.json + tokenizer_config.json",
                               "tokenizer.save_pretrained") from None
    else:
        try:
            tok = AutoTokenizer.from_pretrained(spec)
        except (OSError, ValueError) as err:
            raise _hub_error("tokenizer", spec, err) from None
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise UsageError(f"tokenizer {spec!r} has neither a pad nor an eos token\n"
                             "    fix: use a tokenizer with an eos token (packing separates documents with it)")
        tok.pad_token = tok.eos_token
    return tok


def load_model_config(spec: str):
    """transformers PretrainedConfig for a preset (from model_shapes.PRESETS), a local dir or a hub id."""
    from transformers import AutoConfig

    if model_shapes.is_preset(spec):
        fields = dict(model_shapes.PRESETS[spec])
        # Token ids must match the shipped tokenizer (gpt2's defaults point at id 50256, outside vocab 512).
        # pad_token_id stays unset: llama would make it the embedding's padding_idx, freezing the eos row at
        # zero, yet packed rows use eos as a real input token (document boundary) and never pad.
        eos_id = _shipped_eos_id()
        fields.update(bos_token_id=eos_id, eos_token_id=eos_id)
        return AutoConfig.for_model(fields.pop("model_type"), **fields)
    if Path(spec).is_dir():
        try:
            return AutoConfig.from_pretrained(spec)
        except (OSError, ValueError) as err:
            raise _local_error("model config", spec, err, "config.json", "model.save_pretrained") from None
    try:
        return AutoConfig.from_pretrained(spec)
    except (OSError, ValueError) as err:
        raise _hub_error("model config", spec, err) from None


class _Zero3Config:
    """The two things transformers asks of its registered DeepSpeed config (is_zero3() and .config)."""

    def __init__(self, config: dict):
        self.config = config

    def is_zero3(self) -> bool:
        return self.config.get("zero_optimization", {}).get("stage") == 3


@contextlib.contextmanager
def _zero3_context(zero3_init_config: dict | None):
    """Make transformers construct/load under deepspeed.zero.Init with this config (see module docstring).

    With no config, any earlier registration is removed: otherwise a plain build after a ZeRO-3 build in
    the same process would silently be partitioned too.
    """
    from transformers.integrations import set_hf_deepspeed_config, unset_hf_deepspeed_config

    if zero3_init_config is None:
        if _ZERO3_CONFIG_KEEPALIVE:
            unset_hf_deepspeed_config()
            _ZERO3_CONFIG_KEEPALIVE.clear()
        yield False
        return
    stage = zero3_init_config.get("zero_optimization", {}).get("stage")
    if stage != 3:
        raise ValueError(f"zero3_init_config has zero_optimization.stage={stage!r}; zero.Init needs stage 3")

    marker = _Zero3Config(zero3_init_config)
    _ZERO3_CONFIG_KEEPALIVE[:] = [marker]
    set_hf_deepspeed_config(marker)
    yield True


def _init_preset_weights(model, seed: int, zero3: bool) -> None:
    """Re-run HF init from `seed` so weights do not depend on what construction consumed from the RNG.

    Without ZeRO-3, module constructors draw from the RNG before HF init; under ZeRO-3 transformers
    suppresses those draws. Re-seeding and re-initialising (same module order on both paths, rank 0 under
    ZeRO-3 then broadcast) makes the two paths produce identical weights.
    """
    import torch

    for obj in list(model.modules()) + list(model.parameters()) + list(model.buffers()):
        if hasattr(obj, "_is_hf_initialized"):
            obj._is_hf_initialized = False
    torch.manual_seed(seed)
    if zero3:
        from transformers.integrations.deepspeed import initialize_weights_zero3

        initialize_weights_zero3(model)
    else:
        model.initialize_weights()
    model.tie_weights()


def auto_class(config):
    """transformers' Auto class for a config: AutoModelForImageTextToText for a vision-language model (its config
    has a vision_config: Qwen2-VL, LLaVA, Gemma 3, ...; harness/model/vision.py), AutoModelForSequenceClassification
    for a saved reward model (train.objective=reward records *ForSequenceClassification in architectures), else
    AutoModelForCausalLM."""
    import transformers

    if getattr(config, "vision_config", None) is not None:
        return transformers.AutoModelForImageTextToText
    if any(n.endswith("ForSequenceClassification") for n in getattr(config, "architectures", None) or []):
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModelForCausalLM


def build_model(spec: str, *, seed: int, dtype=None, zero3_init_config: dict | None = None,
                gradient_checkpointing: bool = False, quantization_config=None, head: str = "causal"):
    """AutoModelForCausalLM for a spec: presets get seeded random weights, others their checkpoint. head "reward":
    AutoModelForSequenceClassification with one label (train.objective=reward; its score head seeded), pooling at
    the last token that is not the tokenizer's pad (or EOS) id.

    `zero3_init_config` (a DeepSpeed config dict with zero_optimization.stage 3) makes transformers build
    the model under deepspeed.zero.Init, so no rank ever holds the full weights.
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    from harness.config.moe_families import attn_implementation

    config = load_model_config(spec)
    auto = auto_class(config)  # a vision-language model: its own Auto class
    if head == "reward":
        auto, config.num_labels = AutoModelForSequenceClassification, 1
        config.pad_token_id = config.pad_token_id if config.pad_token_id is not None else _reward_pad_id(spec)
    kwargs = {"attn_implementation": attn_implementation(config, ATTN_IMPLEMENTATION)}
    if dtype is not None:
        kwargs["dtype"] = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if quantization_config is not None:  # QLoRA (model/adapters.py): a pretrained base, 4-bit on its GPU;
        kwargs["quantization_config"] = quantization_config  # under ZeRO-3 zero.Init places it (no device_map)
        if zero3_init_config is None:
            kwargs["device_map"] = {"": torch.cuda.current_device()}
    with _zero3_context(zero3_init_config) as zero3:
        if model_shapes.is_preset(spec):
            torch.manual_seed(seed)
            model = auto.from_config(config, **kwargs)
            _init_preset_weights(model, seed, zero3)
        else:
            torch.manual_seed(seed)  # any weights missing from the checkpoint are initialised reproducibly
            try:
                model = auto.from_pretrained(spec, config=config, **kwargs)
            except (OSError, ValueError) as err:
                if Path(spec).is_dir():
                    raise _local_error("model weights", spec, err, "config.json + *.safetensors",
                                       "model.save_pretrained") from None
                raise _hub_error("model", spec, err) from None
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    if head == "reward":
        model.config.architectures = [type(model).__name__]  # the export builds this class (export/folder.py)
    return model


def _reward_pad_id(spec: str) -> int:
    """The id a reward model pools before: the tokenizer's pad, else its EOS (what the pair store pads with)."""
    tok = load_tokenizer(spec)
    return tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id


def enable_activation_checkpointing(model) -> None:
    """Recompute layer activations in backward; non-reentrant, which works with ZeRO-3 and frozen inputs.

    transformers 5 renamed gradient_checkpointing_enable (now a deprecated alias) to
    activation_checkpointing_enable; use whichever this version has.
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # a KV cache is useless in training and conflicts with recomputation
