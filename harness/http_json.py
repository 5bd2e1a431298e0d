"""JSON over HTTP with a timeout per request and retries, for the harness's clients of outside services (an RL
verifier, a served teacher): a timeout, a refused or dropped connection, a 5xx answer or one that is not JSON is
retried (backoff_s, twice that, ...); a 4xx answer is not. No answer after the retries raises NoAnswer (`refused`:
a 4xx ended it, the request is wrong rather than the service down), which each client turns into its own error that
names the setting and the fix."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request


class NoAnswer(Exception):
    def __init__(self, attempts: int, last: str, refused: bool = False):
        self.attempts, self.last, self.refused = attempts, last, refused
        super().__init__(f"no answer after {attempts} attempt(s): {last}")


def _request(url: str, payload, timeout_s: float) -> object:
    body = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(url, data=body, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as answer:
        return json.loads(answer.read().decode())


def call_json(url: str, payload=None, *, timeout_s: float, retries: int, backoff_s: float) -> object:
    """The JSON answer of a GET (payload None) or a POST of payload as JSON."""
    last, refused = "", False
    for attempt in range(retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            return _request(url, payload, timeout_s)
        except urllib.error.HTTPError as err:
            last = f"HTTP {err.code} {err.reason}"
            if err.code < 500:
                refused = True
                break
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as err:
            last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        except json.JSONDecodeError as err:
            last = f"not JSON ({err})"
    raise NoAnswer(attempt + 1, last, refused)
