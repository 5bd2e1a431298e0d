"""The long-context terms of the activation memory (memory.activation_bytes is the one entry point; it calls these).

Per rank, t = seq_len x micro_batch / sp tokens (Ulysses sequence parallelism splits the sequence over sp ranks;
inside attention each rank holds the whole sequence for heads / sp, the same number of elements), lp bytes per
element of the training precision:

- Saved for backward per block: t x lp x the elements memory._layer_token_elems lists (the per-tensor accounting of
  Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", arXiv 2205.05198, s4.1,
  with flash/sdpa attention: no s x s scores). Eager attention adds its scores and softmax, 2 x heads x s^2 x lp per
  block and micro-batch (their 5as^2b without dropout).
- Under Ulysses (sp > 1) one more copy of the attention output per block: the all-to-all gives it back in the
  sequence layout for o_proj while the attention kernel keeps its heads layout (Jacobs et al. 2023, DeepSpeed-Ulysses,
  arXiv 2309.14509 s3; ALST, Bekman et al. 2025, arXiv 2506.13996 s3.2).
- Tiled MLP (ALST s3.3, DeepSpeed's TiledMLP; the harness's train.tiled_mlp): the MLP runs over tiles of
  train.tile_tokens tokens and is recomputed in backward, so a block keeps none of its MLP intermediates; one tile
  holds them (and their gradients, x2) in the block being computed.
- Logits: 16-bit logits, their fp32 upcast (none in fp32 training) and log-softmax, for all t tokens; tiled loss
  (ALST s3.3; the harness's train.tiled_loss) holds one tile of train.tile_tokens tokens, plus one lm_head-sized
  gradient buffer.
- Preference objectives (train.objective dpo, ipo, simpo, orpo): a micro-batch of B pairs is 2B sequences (chosen
  and rejected), so t counts both; the logits term is pair_logits_bytes (row-by-row log-probs, no fp32 copy).
- Attention masks: flash-attention varlen and flex build none (flex's block mask is O((s/128)^2), left out).
  sdpa: a bool (s/sp)^2 mask per micro-batch from transformers at sp 1 (s^2); under Ulysses sdpa would lose the
  document mask, so the harness runs its document_sdpa there (model/sequence/attention.py), which builds the mask
  after the all-to-all over the FULL sequence: s^2 booleans per micro-batch on every rank (and keeps transformers
  from building its own (s/sp)^2 one, which it would otherwise build and discard). torch's sdpa turns a bool mask
  into an additive one in the query's dtype and its backward keeps that copy (measured on CPU, torch 2.13:
  ScaledDotProductFlashAttentionForCpuBackward saves a float32 [b, 1, s, s] attn_mask): s^2 x lp more per block
  that runs with gradients (every block; with checkpointing the one recomputed). eager: (s/sp)^2 in the training
  dtype and its scores; refused under SP.
- Activation checkpointing keeps each block's input (t x h x lp); activation offload (ALST s3.4) moves those to CPU
  RAM and keeps two on the device (the one copied out and the one prefetched back in backward).
"""

from __future__ import annotations

import math

from harness.config.defaults import TILE_TOKENS
from harness.planner.shape import ModelShape

# "materialized": Megatron's s x s scores, which only the step time of published runs reads (steptime.py)
ATTENTIONS = ("flash", "flex", "sdpa", "eager", "materialized")
MASK_BOOL_BYTES = 1


def tokens_per_rank(seq_len: int, micro_batch: int, sp: int) -> int:
    return math.ceil(seq_len / sp) * micro_batch


def mlp_token_elems(shape: ModelShape, tp: int) -> float:
    """The MLP intermediates memory._layer_token_elems counts per token: gate, up, act(gate), act*up (GLU
    families), fc out and gelu out (gpt2); split by tp."""
    inter = shape.intermediate_size
    return (2 if shape.model_type == "gpt2" else 4) * inter / tp


def sp_token_elems(shape: ModelShape, tp: int, sp: int) -> float:
    """Elements per token a block keeps under Ulysses beyond sp=1's: the attention output in both layouts."""
    return shape.num_attention_heads * shape.head_dim / tp if sp > 1 else 0.0


def mlp_tile_bytes(shape: ModelShape, tokens: int, lp: int, tp: int, tile_tokens: int = TILE_TOKENS) -> int:
    """Working bytes of one TiledMLP tile: its intermediates recomputed in backward and their gradients."""
    return int(2 * min(tokens, tile_tokens) * lp * mlp_token_elems(shape, tp))


def logits_bytes(tokens: int, shape: ModelShape, lp: int, tiled: bool, tile_tokens: int = TILE_TOKENS) -> int:
    """The 16-bit logits plus the fp32 upcast and log-softmax HF's loss keeps, for every token (in fp32 training
    `.float()` returns the logits themselves: no upcast copy; measured, bench/long_context.py concat rows); tiled:
    for one tile, plus the lm_head-sized gradient buffer the tiled loss keeps."""
    vocab = shape.vocab_size
    per = lp + (4 if lp < 4 else 0) + 4
    if not tiled:
        return int(tokens * vocab * per)
    return int(min(tokens, tile_tokens) * vocab * per + vocab * shape.hidden_size * lp)


def pair_logits_bytes(tokens: int, seq_len: int, shape: ModelShape, lp: int) -> int:
    """A preference objective's logits (harness/train/objectives.py label_logps): the 16-bit logits of all 2B rows
    kept for backward and, in backward, their gradient of the same size; one row at a time is up-cast to fp32 and
    exponentiated (two fp32 [seq_len, vocab] tensors). No fp32 copy of the whole logits, unlike the LM loss."""
    vocab = shape.vocab_size
    return int(2 * tokens * vocab * lp + 2 * seq_len * vocab * 4)


def rollout_logits_bytes(completion_tokens: int, shape: ModelShape, lp: int) -> int:
    """An RL step's logits (harness/train/grpo.py, rl/loss.py): the forward keeps only the completion positions
    (logits_to_keep), gathers them per row (a second 16-bit copy), up-casts to fp32 and takes the log-softmax, both
    kept for backward: completion tokens x vocab x (2 lp + 8)."""
    return int(completion_tokens * shape.vocab_size * (2 * lp + 8))


def distill_chunk_tensors(beta: float) -> int:
    """float32 [chunk, vocab] tensors at the peak of one chunk of the distillation loss (harness/train/distill_loss.py:
    the up-cast student and teacher rows, their log-softmaxes, the divergence's terms and autograd's saved ones),
    measured on CPU at vocab 152,064 with ru_maxrss: 6.5 at beta 0, 7.5 at beta 1, 10.5 between (the mixture's
    log m and both KL terms), rounded up."""
    return 7 if beta == 0 else 8 if beta == 1 else 11


def distill_logits_bytes(tokens: int, shape: ModelShape, lp: int, chunk_tokens: int, beta: float) -> int:
    """A distillation loss's logits (harness/train/distill.py): the student's forward logits, their copy at the loss
    tokens and its gradient (16-bit, at most every token each), and the loss in float32 over one chunk of tokens at
    a time, never the whole B x L x V in float32. The teacher's own targets are its mode's (planner/teacher.py)."""
    vocab = shape.vocab_size
    return int(3 * tokens * vocab * lp + distill_chunk_tensors(beta) * min(tokens, chunk_tokens) * vocab * 4)


def mask_bytes(attention: str, seq_len: int, sp: int, micro_batch: int, lp: int) -> int:
    """The attention mask materialised per rank and micro-batch: s^2 booleans for sdpa (at sp 1 transformers',
    under SP the harness's document_sdpa over the full sequence), (s/sp)^2 in the training dtype for eager; none for
    flash-attention and flex."""
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r}: expected one of {', '.join(ATTENTIONS)}")
    local = math.ceil(seq_len / sp)
    if attention == "sdpa":  # sp > 1: the harness's document_sdpa over the gathered sequence
        return micro_batch * seq_len * seq_len * MASK_BOOL_BYTES
    if attention == "eager":
        return micro_batch * local * local * lp
    return 0


def scores_bytes(shape: ModelShape, attention: str, seq_len: int, sp: int, micro_batch: int, lp: int, tp: int) -> int:
    """What one block's attention keeps for backward beyond q, k, v and the output: eager its scores and softmax,
    2 x heads/(tp sp) x s^2; sdpa the additive copy of the bool mask in the training dtype, s^2 (the whole sequence
    under SP: document_sdpa runs after the all-to-all); per micro-batch."""
    if attention == "sdpa":
        return int(micro_batch * seq_len * seq_len * lp)
    if attention != "eager":
        return 0
    return int(2 * shape.num_attention_heads / (tp * sp) * seq_len * seq_len * micro_batch * lp)
