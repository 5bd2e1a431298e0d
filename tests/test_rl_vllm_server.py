"""rl.async with rl.vllm_mode server (harness/rl/generation/vllm_server.py), what runs without a GPU, in one process:
- TRL's key resolution: vllm_server_base_url wins over host and port; TRL's defaults otherwise;
- the refusals before launch: vllm_mode server without rl.async, with rl.generator hf, rl.async with a colocated
  vLLM (harness validate, exit 2 with the fix); on this CPU-only machine the server mode itself (the weights go over
  NCCL from a CUDA device), with the command that starts the server in the fix;
- the server check: a port nothing listens on, and a 127.0.0.1 stand-in whose /health answers 503, are unreachable
  with the reason and the timeout; one whose /health answers 200 is reachable.
- the request side on TRL's real VLLMClient against a 127.0.0.1 stand-in of vLLM's /v1/completions answering from
  the tiny Llama's HF generate: one request per row with its seed row_seed(seed, global row) (4 rows from one rank
  equal them from two), the server's log-probs carried, the version tagged at ask time; a server answering 400 or
  hanging past rl.async_timeout_s ends the wait with the reason (no hang at exit either).
The weight sync (NCCL from rank 0's CUDA device into the server) needs a GPU and vllm: bench/gpu_check.sh
grpo_async_vllm runs the whole against a real `trl vllm-serve`.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.cli import main
from harness.rl.generation.vllm_server import DEFAULT_HOST, DEFAULT_PORT, server_url, unreachable


def test_the_server_url_is_trls_resolution():
    assert server_url({}) == f"http://{DEFAULT_HOST}:{DEFAULT_PORT}" == "http://0.0.0.0:8000"
    assert server_url({"vllm_server_host": "10.0.0.2", "vllm_server_port": 8001}) == "http://10.0.0.2:8001"
    assert server_url({"vllm_server_base_url": "http://gen:9000/", "vllm_server_host": "10.0.0.2",
                       "vllm_server_port": 8001}) == "http://gen:9000"


def test_the_schema_defaults_are_trls():
    from trl import GRPOConfig

    from harness.config.schema import load_schema

    rl = load_schema("recipe.schema.json")["properties"]["rl"]["properties"]
    for key in ("vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout",
                "vllm_group_port"):
        assert rl[key]["default"] == GRPOConfig.__dataclass_fields__[key].default, key


def _validate(tmp_path, rl: dict, capsys) -> tuple[int, str]:
    recipe = {"description": "grpo", "train": {"objective": "grpo"}, "batch": {"micro_batch_per_gpu": 4},
              "rl": {"num_generations": 4, **rl}}
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    code = main(["validate", str(path), "--world-size", "2"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("rl,message", [
    ({"generator": "vllm", "vllm_mode": "server"}, "rl.vllm_mode: vllm_mode server without rl.async"),
    ({"async": True, "vllm_mode": "server"}, "rl.vllm_mode: vllm_mode server with generator hf"),
    ({"async": True, "generator": "vllm"}, "rl.vllm_mode: rl.async with generator vllm and vllm_mode colocate"),
])
def test_server_mode_outside_rl_async_with_vllm_is_refused(tmp_path, capsys, rl, message):
    code, err = _validate(tmp_path, rl, capsys)
    assert code == 2 and message in err and "fix:" in err, err


def test_rl_async_with_the_server_validates(tmp_path, capsys):
    code, err = _validate(tmp_path, {"async": True, "generator": "vllm", "vllm_mode": "server"}, capsys)
    assert code == 0, err


def test_server_mode_is_refused_before_launch_without_cuda():
    import torch

    from harness.rl.generation import generator_problems

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    recipe = {"train": {"objective": "grpo"},
              "rl": {"async": True, "generator": "vllm", "vllm_mode": "server", "vllm_server_timeout": 0.1}}
    [problem] = generator_problems(recipe)
    assert problem.path == "rl.vllm_mode" and "do not train on CUDA" in problem.message
    assert "trl vllm-serve --model" in problem.fix and "rl.generator=hf" in problem.fix


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 - http.server's name
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def _serve(status: int):
    handler = type("Handler", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_the_server_check_names_the_reason_and_the_timeout():
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    why = unreachable(f"http://127.0.0.1:{port}", 0.3, retry_s=0.1)
    assert why.startswith(f"the vLLM server at http://127.0.0.1:{port} does not answer (GET")
    assert "ConnectionError" in why and "rl.vllm_server_timeout = 0.3 s" in why
    down, url = _serve(503)
    up, up_url = _serve(200)
    try:
        assert "answered 503" in unreachable(url, 0.3, retry_s=0.1)
        assert unreachable(up_url, 0.3, retry_s=0.1) is None
    finally:
        for server in (down, up):
            server.shutdown()
            server.server_close()


class _Completions:
    """The part of vLLM's OpenAI-compatible API that VLLMClient.generate asks: tests/helpers/teacher_server.py's
    GET /health and /v1/models, and POST /v1/completions with one token-id prompt, `seed` and `logprobs` 0 answered
    by the tiny Llama's HF generate with the request's seed as its one row's stream; `fail` answers 400 to
    completions, `hang` never answers them."""
    generator, mode, seen, lock = None, "ok", [], threading.Lock()

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        if self.mode == "hang":
            time.sleep(30)
        if self.mode == "fail":
            return self._send(400, {"error": "model is not loaded"})
        [prompt] = body["prompt"]
        with self.lock:  # one generator: another thread's generate would replace last_logps before it is read
            [completion] = self.generator.generate([prompt], seed=body["seed"], row_ids=[0],
                                                   max_new=body["max_tokens"])
            logps = self.generator.last_logps[0]
        self._send(200, {"choices": [{"prompt_token_ids": prompt, "token_ids": completion, "logprobs": {
            "tokens": [f"token_id:{t}" for t in completion], "token_logprobs": logps,
            "top_logprobs": [None] * len(completion)}}]})


@pytest.fixture(scope="module")
def completions_server():
    from types import SimpleNamespace

    from harness.model.hf import build_model, load_tokenizer
    from harness.rl.generation.hf import HFGenerator
    from helpers.teacher_server import handler as teacher_handler

    rl = {"max_completion_length": 6, "temperature": 1.0}
    model = build_model("tiny-llama", seed=0).eval()
    generator = HFGenerator(rl, SimpleNamespace(module=model), load_tokenizer("tiny-llama"), bound_bytes=None)
    base = teacher_handler(model, "tiny-llama", None, None, {"answered": 0})
    handler = type("Handler", (_Completions, base), {"generator": generator, "seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, handler, rl
    server.shutdown()
    server.server_close()


def _client_side(url: str, rl: dict, monkeypatch, *, first_row: int, rows: int, timeout_s: float = 60.0):
    """ServerGeneration's request side (the schedule's state and its client thread; no engine: the weight sync
    needs CUDA and the server's NCCL engine) on TRL's real VLLMClient. TRL's constructor refuses without the vllm
    package, which its HTTP generate does not use: that guard alone is lifted here."""
    from trl.generation import vllm_client

    from harness.rl.generation.vllm_server import ServerGeneration, sampling_kwargs

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
    side = ServerGeneration.__new__(ServerGeneration)
    side.rl, side.rank, side.timeout_s, side.staleness, side.last_step = {**rl, "vllm_server_base_url": url}, 0, \
        timeout_s, 1, 3
    side.failure, side.results, side.dropped, side.synced, side.asked = None, {}, 0, 0, -1
    side.request = lambda step: ([[5 + step, 7, 9 + r] for r in range(first_row, first_row + rows)], 11 + step,
                                 first_row)
    side.sampling, side.client = sampling_kwargs(rl), vllm_client.VLLMClient(base_url=url)
    side._start_thread()
    return side


def test_rollouts_come_back_per_row_seeded_with_vllms_logps_and_the_version(completions_server, monkeypatch):
    """Each row is its own request with the seed row_seed(seed, global row), so 4 rows asked by one rank equal
    the same rows asked by two (first_row 0 and 2); the log-probs are the server's; the version is the one synced
    when the step was asked."""
    from harness.rl.generation.sampling import row_seed

    server, handler, rl = completions_server
    url = f"http://127.0.0.1:{server.server_address[1]}"
    one = _client_side(url, rl, monkeypatch, first_row=0, rows=4)
    one.ask(0)
    one.synced = 1  # a sync between the asks
    one.ask(1)
    got = [one.take(0), one.take(1)]
    assert [g["version"] for g in got] == [0, 1] and "error" not in got[0]
    seeds = sorted(b["seed"] for b in handler.seen if b["prompt"][0][0] == 5)
    assert seeds == sorted(row_seed(11, r) for r in range(4))
    assert all(b["logprobs"] == 0 and b["max_tokens"] == 6 and b["n"] == 1 for b in handler.seen)
    two = [_client_side(url, rl, monkeypatch, first_row=f, rows=2) for f in (0, 2)]
    for side in two:
        side.ask(0)
    split = [side.take(0) for side in two]
    assert split[0]["completions"] + split[1]["completions"] == got[0]["completions"]
    # the same rows' log-probs (to float tolerance). The stand-in once answered concurrent requests with another
    # thread's log-probs (its one generator's last_logps read unlocked; tokens right): a CI rehearsal caught it
    for a, b in zip(split[0]["sampling_logps"] + split[1]["sampling_logps"], got[0]["sampling_logps"], strict=True):
        assert len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b)), (a, b)
    assert all(len(c) == len(lp) > 0 for c, lp in zip(got[0]["completions"], got[0]["sampling_logps"]))
    for side in (one, *two):
        side.jobs.put(None)


@pytest.mark.parametrize("mode,why", [
    ("fail", "asking the rollouts of step 1 raised Exception: Request failed: 400"),
    ("hang", "no rollouts for step 1 within rl.async_timeout_s = 1 s"),
])
def test_a_failing_or_silent_server_ends_the_wait_with_the_reason(completions_server, monkeypatch, mode, why):
    server, handler, rl = completions_server
    url = f"http://127.0.0.1:{server.server_address[1]}"
    side = _client_side(url, rl, monkeypatch, first_row=0, rows=2, timeout_s=1.0)
    monkeypatch.setattr(handler, "mode", mode)
    side.ask(0)
    began = time.monotonic()
    out = side.take(0)
    assert time.monotonic() - began < 20
    assert out["error"].startswith(f"rank 0: rl.async's vLLM server at {url} failed: {why}"), out
    assert "fix: check the server's log" in out["error"]
    side.jobs.put(None)
