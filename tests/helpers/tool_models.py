"""A tiny Llama that calls tools (tests/test_rl_tools.py): the built-in byte-level BPE tokenizer under Qwen2.5's chat
template (tests/helpers/chat_templates.py), with each whole Hermes tool call added as one token, and a head that
samples those calls and the end of turn (<|im_end|>) often from the start, so that a few steps of GRPO on the
toy environment (tests/fixtures/rl_tools/secret_env.py, reward 1 once reveal() ran) learn to call more."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from helpers.chat_templates import template_tokenizer

ENV_FILE = Path(__file__).resolve().parents[1] / "fixtures" / "rl_tools" / "secret_env.py"
CALLS = {"reveal": {}, "broken": {"word": "x"}}  # tool -> the arguments its call token carries
SECRETS = ("apple", "river", "stone", "cloud", "lamp", "seed", "wind", "door")


def call_text(name: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": CALLS[name]}) + "\n</tool_call>"


def tool_tokenizer():
    tok = template_tokenizer("qwen2_5")
    tok.add_tokens([call_text(n) for n in CALLS])
    return tok


def tool_model_folder(path, seed: int = 1234, logit_boost: dict | None = None) -> str:
    """The model and its tokenizer. logit_boost: {token text: logit added at every position} (defaults: the reveal
    call 3.5, the broken call 2.5, <|im_end|> 4.5), made by one embedding dimension held constant and the head's
    weight on it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = tool_tokenizer()
    boost = logit_boost or {call_text("reveal"): 3.0, call_text("broken"): 2.0, "<|im_end|>": 5.0}
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, attention_dropout=0.0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        ids = torch.randint(0, len(tok), (4, 32), generator=torch.Generator().manual_seed(seed))
        level = model.model(input_ids=ids).last_hidden_state[..., 0].mean()
        for text, logit in boost.items():
            model.lm_head.weight[tok.convert_tokens_to_ids(text), 0] = logit / level
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def write_prompts(path: Path, count: int = 16, walled: set | None = None) -> Path:
    """count conversational prompts, each with its secret column (SecretEnv.reset reads it). With `walled`, each
    record names its environment (rl.environment_factory {"secret": SecretEnv, "wall": WallEnv}): the records in
    walled get WallEnv, whose every tool result overflows the budget, so their rollouts end at the first turn."""
    rows = [{"prompt": [{"role": "user", "content": "What is the secret word? Ask the tool."}],
             "secret": SECRETS[i % len(SECRETS)]} for i in range(count)]
    if walled is not None:
        for i, row in enumerate(rows):
            row["environment"] = "wall" if i in walled else "secret"
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path)


def second_rank_records(count: int, seed: int, generations: int, per_step: int) -> set:
    """The prompt records that the second of two ranks holds in the first `generations` generations of a run with
    `per_step` prompts a step (harness/train/grpo.py: rank r takes the step's prompts [r * per_step / 2, ...))."""
    from harness.data.batches import BatchPlan

    plan = BatchPlan(num_rows=count, global_batch=per_step, micro_batch=per_step, grad_accum=1, seed=seed)
    return {int(i) for g in range(generations) for i in plan.global_rows(g)[per_step // 2:]}


class Scripted:
    """A generator of fixed turns (harness/rl/generation's contract): turn t of row r is script[r][t]."""

    def __init__(self, script: list[list[list[int]]]):
        self.script, self.calls, self.last_logps = script, [], []

    def generate(self, prompt_ids, *, seed, first_row=0, row_ids=None, max_new=None):
        self.calls.append((list(row_ids), max_new))
        out = [self.script[r][sum(r in ids for ids, _ in self.calls[:-1])][:max_new] for r in row_ids]
        self.last_logps = [[-0.5] * len(o) for o in out]
        return out


def pieces(tok, text: str) -> list[int]:
    """Byte-level BPE pieces of `text` one character at a time: ids a sampler may draw that re-tokenizing the
    decoded text would merge."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]]
