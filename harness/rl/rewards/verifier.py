"""The HTTP verifier (an entry {"verifier": URL, ...}): the completions are POSTed in batches of `batch_size` as
JSON {"prompts", "completions", "completion_ids", and every dataset column}; the answer is {"rewards": [...]} (or
the bare list), one float or null per completion. Each request has `timeout_s`; a timeout, a refused connection or
a 5xx answer is retried `retries` times (0.2 s, 0.4 s, ... apart); a 4xx answer is not. At most `concurrency`
requests are in flight."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from harness.http_json import NoAnswer, call_json

BACKOFF_S = 0.2


class VerifierError(Exception):
    """The verifier did not give rewards for a batch (after its retries)."""


def _rewards(reply, n: int, url: str) -> list:
    rewards = reply.get("rewards") if isinstance(reply, dict) else reply
    if not isinstance(rewards, list) or len(rewards) != n or \
            not all(r is None or isinstance(r, (int, float)) for r in rewards):
        raise VerifierError(f"{url} answered {str(reply)[:200]!r}: expected {{\"rewards\": [{n} numbers or null]}}")
    return [None if r is None else float(r) for r in rewards]


def ask(url: str, batch: dict, n: int, *, timeout_s: float, retries: int) -> list:
    """One batch's rewards, with retries."""
    try:
        reply = call_json(url, batch, timeout_s=timeout_s, retries=retries, backoff_s=BACKOFF_S)
    except NoAnswer as err:
        raise VerifierError(f"{url} gave no rewards after {err.attempts} attempt(s): {err.last}") from None
    return _rewards(reply, n, url)


def verifier(entry: dict):
    url = entry["verifier"]
    timeout_s, retries = float(entry.get("timeout_s", 30)), int(entry.get("retries", 2))
    size, concurrency = int(entry.get("batch_size", 64)), int(entry.get("concurrency", 4))

    def verify(prompts, completions, completion_ids=None, **columns):
        n = len(completions)
        ids = completion_ids or [None] * n
        starts = list(range(0, n, size))

        def one(start):
            end = min(start + size, n)
            batch = {"prompts": prompts[start:end], "completions": completions[start:end],
                     "completion_ids": ids[start:end], **{k: list(v[start:end]) for k, v in columns.items()}}
            return ask(url, batch, end - start, timeout_s=timeout_s, retries=retries)

        with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(starts) or 1))) as pool:
            return [r for part in pool.map(one, starts) for r in part]
    verify.__name__ = "verifier"
    return verify
