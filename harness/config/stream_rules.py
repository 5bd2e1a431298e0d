"""train.streaming's rules (harness/data/stream_rows.py): what a store written while the run trains can serve."""

from __future__ import annotations

from harness.errors import Problem
from harness.config.preference_rules import is_preference
from harness.config.resolve import Context


def shard_rows(shard_tokens: int, seq_len: int) -> int:
    """Rows per shard of a streamed store (harness/data/shards.py): whole rows, at least one."""
    return max(1, int(shard_tokens) // max(1, int(seq_len)))


def check_streaming(ds: dict, ctx: Context) -> list[Problem]:
    train = ctx.recipe.get("train", {})
    if not train.get("streaming"):
        return []
    out = []
    if is_preference(ctx.recipe):
        out.append(Problem("train.streaming", f"streaming with objective {train.get('objective')!r}: preference "
                           "pairs are read from their own store, built before the run",
                           "set train.streaming=false (the pair store is built once, by `harness data prepare "
                           "--set train.objective=...` or the launch), or objective lm"))
    rows, fraction = shard_rows(train.get("stream_shard_tokens", 1), train.get("seq_len", 1)), float(train.get("eval_fraction", 0) or 0)
    held = max(1, round(rows * fraction)) if fraction > 0 else 0
    if held >= rows:
        out.append(Problem("train.stream_shard_tokens", f"{train.get('stream_shard_tokens')} tokens per shard is "
                           f"{rows} row(s) of seq_len={train.get('seq_len')}, and the eval split takes "
                           f"eval_fraction={fraction} of the first shard: {held} row(s), leaving none to train",
                           f"raise train.stream_shard_tokens to at least {2 * int(train.get('seq_len', 1))} tokens, "
                           "or set train.eval_fraction=0"))
    return out
