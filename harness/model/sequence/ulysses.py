"""Ulysses sequence parallelism: the SP groups (set up once per process) and each micro-batch's shard.

DeepSpeed's UlyssesSPAttentionHF.register_with_transformers replaces the chosen attention implementation in
transformers' global table with its all-to-all wrapper and returns an mpu (parallel_state_sp) for
deepspeed.initialize. SP groups are consecutive ranks (0..sp-1, sp..2sp-1, ...), so a rank's data-parallel
coordinate is rank // sp of world // sp. Because the patch is process-wide, a process sets SP up once: a second
call with the same settings returns the first mpu, other settings are refused.
"""

from __future__ import annotations

_state: dict = {}  # {"key": (attention, sp, micro), "mpu": mpu}


def setup(model, attention: str, sp: int, micro: int):
    """The mpu for deepspeed.initialize (None at sp=1). `model` is the built HF model (its config names the
    attention implementation already: harness.model.sequence.attention.apply)."""
    if sp == 1:
        return None
    key = (attention, sp, micro)
    if _state:
        if _state["key"] != key:
            raise RuntimeError(f"sequence parallelism is set up once per process (it patches transformers' attention "
                               f"table): set up as {_state['key']}, asked for {key}")
        return _state["mpu"]
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation=attention, sequence_parallel_size=sp,
        micro_batch_size=micro, seq_length_is_variable=True)
    _state.update(key=key, mpu=mpu)
    return mpu


def shift_labels(labels):
    """Labels for next-token prediction, shifted BEFORE sharding: position t carries label t+1, the last -100."""
    import torch

    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def default_positions(ids):
    import torch

    return torch.arange(ids.shape[1], dtype=torch.long).expand(ids.shape[0], -1).contiguous()


def shard(batch, sp_rank: int, sp: int):
    """(input_ids, shifted labels, position_ids) of this SP rank's contiguous slice of the sequence; the batch is
    (input_ids, labels[, position_ids]) for the whole sequence, position ids restarting per document or absent."""
    ids, labels = batch[0], batch[1]
    positions = batch[2] if len(batch) > 2 and batch[2] is not None else default_positions(ids)
    shifted = shift_labels(labels)
    seq = ids.shape[1]
    if seq % sp:
        raise ValueError(f"seq_len {seq} is not divisible by sequence parallel degree {sp}")
    part = seq // sp
    cut = slice(sp_rank * part, (sp_rank + 1) * part)
    return ids[:, cut].contiguous(), shifted[:, cut].contiguous(), positions[:, cut].contiguous()


def probe_logits(engine, probe_ids):
    """The engine's logits on `probe_ids` [1, L] under Ulysses (every SP rank calls: the wrapper's all-to-alls are
    collective): the row repeated to the micro-batch the wrapper was set up for, each SP rank its contiguous
    slice with its global position ids, the slices' logits all-gathered over the SP group. L must split over sp
    (the caller cuts it). Returns [1, L, vocab] float32 on the CPU, on every rank."""
    import torch
    import torch.distributed as tdist

    sp, group = engine.sequence_parallel_size, engine.seq_parallel_group
    micro, length = engine.train_micro_batch_size_per_gpu(), probe_ids.shape[1]
    if length % sp:
        raise ValueError(f"probe length {length} does not split over sequence-parallel degree {sp}")
    ids = probe_ids[:1].expand(micro, -1)
    part = length // sp
    cut = slice(tdist.get_rank(group) * part, (tdist.get_rank(group) + 1) * part)
    positions = default_positions(ids)[:, cut].contiguous()
    logits = engine(input_ids=ids[:, cut].contiguous().to(engine.device), position_ids=positions.to(engine.device),
                    use_cache=False).logits.float().contiguous()
    parts = [torch.empty_like(logits) for _ in range(sp)]
    tdist.all_gather(parts, logits, group=group)
    return torch.cat(parts, dim=1)[:1].cpu()
