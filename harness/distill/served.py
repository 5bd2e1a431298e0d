"""The served teacher (`teacher_model_server_url`): an endpoint with vLLM's OpenAI-compatible API scores each row's
tokens and returns the top-k prompt log-probs, as TRL 1.16's ServerDistillationTrainer asks vLLM (its VLLMClient.
get_sequence_logprobs): GET /health, GET /v1/models (the first model's id), then per micro-batch one

    POST /v1/completions {"model": ID, "prompt": [[token ids], ...], "max_tokens": 1, "temperature": T,
                          "prompt_logprobs": k}

whose answer holds, per sequence, choices[i]["prompt_logprobs"]: None for the first token, then per position q a
{token id: {"logprob", "rank", "decoded_token"}} of the distribution of token q given the tokens before it (the top
k and the token actually there). A row's sequence is its tokens up to its last loss token; its loss tokens' entries
are kept, sorted by rank, cut to k, padded with (-inf, id 0) as TRL pads them.

Each request has `timeout_s`; a timeout, a refused or dropped connection, a 5xx answer or one that is not JSON is
retried `retries` times (BACKOFF_S, twice that, ...: harness/http_json.py); a 4xx or a malformed answer is not.
When no answer comes the run ends with TeacherUnavailable: the URL, the attempts, the last error and the fix, never
a hang, and exit EXIT_TEACHER_UNAVAILABLE (69: an outage, retried by `harness launch --max-restarts`, Kubernetes, Ray
and the Slurm script). A 4xx or a malformed answer is TeacherServerError (exit 2: the server or the settings are
wrong, a retry would get the same answer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from harness.distill.topk import TopK, loss_positions
from harness.errors import UsageError
from harness.http_json import NoAnswer, call_json

BACKOFF_S = 0.5


class TeacherServerError(UsageError):
    """The served teacher refused the request (a 4xx) or answered malformed log-probs: bad input, exit 2."""


class TeacherUnavailable(Exception):
    """The served teacher gave no answer after its retries (timeouts, refused or dropped connections, 5xx answers):
    an outage, exit EXIT_TEACHER_UNAVAILABLE (harness/train/job.py), which the launchers retry."""


def call(url: str, payload: dict | None, *, timeout_s: float, retries: int, what: str) -> dict:
    """The JSON answer of one GET (payload None) or POST, with retries; TeacherUnavailable when none comes,
    TeacherServerError when the server refused the request."""
    try:
        return call_json(url, payload, timeout_s=timeout_s, retries=retries, backoff_s=BACKOFF_S)
    except NoAnswer as err:
        text = (f"distill.teacher_model_server_url: the served teacher gave no {what} after {err.attempts} "
                f"attempt(s) ({timeout_s:g} s timeout each): {url}: {err.last}")
        if err.refused:
            raise TeacherServerError(f"{text}\n    fix: check the server's limits against the request (vLLM's "
                                     "--max-logprobs must be at least distill.loss_top_k)") from None
        raise TeacherUnavailable(f"{text}\n    fix: check that the server is up (curl {url.rsplit('/v1/', 1)[0]}"
                                 f"/health) and answers within {timeout_s:g} s; the run ended with exit 69, which "
                                 "`harness launch --max-restarts`, Kubernetes, Ray and the Slurm script retry "
                                 "from the latest checkpoint") from None


def position_topk(entry: dict | None, actual_id: int, k: int) -> tuple[list[int], list[float], float]:
    """(ids, log-probs, actual token's log-prob) of one position's prompt_logprobs entry, as TRL reads it."""
    items = sorted((entry or {}).items(), key=lambda item: item[1]["rank"])[:k]
    logps = [-math.inf if math.isnan(v["logprob"]) else float(v["logprob"]) for _, v in items]
    ids = [int(t) for t, _ in items]
    actual = (entry or {}).get(str(actual_id))
    actual_logp = -math.inf if actual is None or math.isnan(actual["logprob"]) else float(actual["logprob"])
    return ids + [0] * (k - len(ids)), logps + [-math.inf] * (k - len(logps)), actual_logp


@dataclass
class ServedTeacher:
    url: str  # the server's base URL, "http://127.0.0.1:8000"
    k: int
    temperature: float
    timeout_s: float = 60.0
    retries: int = 2
    model: str = ""  # the served model's id, read from /v1/models by connect()

    def connect(self) -> "ServedTeacher":
        base = self.url.rstrip("/")
        call(f"{base}/health", None, timeout_s=self.timeout_s, retries=self.retries, what="health answer")
        models = call(f"{base}/v1/models", None, timeout_s=self.timeout_s, retries=self.retries, what="model list")
        try:
            self.model = models["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise TeacherServerError(f"distill.teacher_model_server_url: {base}/v1/models answered "
                                     f"{str(models)[:200]!r}: expected {{\"data\": [{{\"id\": MODEL}}]}}") from None
        return self

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor) -> TopK:
        """The top-k targets of the loss tokens of labels [B, L] (topk.loss_positions' order)."""
        rows, pos = loss_positions(labels)
        targets = (pos + 1).tolist()
        ends = {r: q + 1 for r, q in zip(rows.tolist(), targets)}  # a row's sequence ends at its last loss token
        order = sorted(ends)
        answer = self._score([input_ids[r, :ends[r]].tolist() for r in order]) if order else []
        by_row = dict(zip(order, answer))
        ids, logps, actual = [], [], []
        for r, q in zip(rows.tolist(), targets):
            i, lp, a = position_topk(by_row[r][q], int(input_ids[r, q]), self.k)
            ids.append(i)
            logps.append(lp)
            actual.append(a)
        return TopK(torch.tensor(ids, dtype=torch.int64).reshape(-1, self.k),
                    torch.tensor(logps, dtype=torch.float32).reshape(-1, self.k),
                    torch.tensor(actual, dtype=torch.float32))

    def _score(self, sequences: list[list[int]]) -> list[list]:
        """Each sequence's prompt_logprobs list."""
        url = f"{self.url.rstrip('/')}/v1/completions"
        payload = {"model": self.model, "prompt": sequences, "max_tokens": 1, "temperature": self.temperature,
                   "prompt_logprobs": self.k}
        reply = call(url, payload, timeout_s=self.timeout_s, retries=self.retries, what="prompt log-probs")
        choices = reply.get("choices") if isinstance(reply, dict) else None
        scored = [c.get("prompt_logprobs") for c in choices or [] if isinstance(c, dict)]
        if len(scored) != len(sequences) or any(not isinstance(s, list) or len(s) != len(q)
                                                for s, q in zip(scored, sequences)):
            raise TeacherServerError(
                f"distill.teacher_model_server_url: {url} answered {str(reply)[:200]!r}: expected one choice per "
                f"sequence ({len(sequences)}), each with prompt_logprobs for every token\n    fix: serve the teacher "
                f"with vLLM's OpenAI-compatible server (`vllm serve MODEL`), which returns prompt_logprobs")
        return scored
