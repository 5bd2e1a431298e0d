"""rl.async with rl.vllm_mode server (harness/rl/generation/vllm_server.py), what runs without a GPU, in one process:
- TRL's key resolution: vllm_server_base_url wins over host and port; TRL's defaults otherwise;
- the refusals before launch: vllm_mode server without rl.async, with rl.generator hf, rl.async with a colocated
  vLLM (harness validate, exit 2 with the fix); on this CPU-only machine the server mode itself (the weights go over
  NCCL from a CUDA device), with the command that starts the server in the fix;
- the server check: a port nothing listens on, and a 127.0.0.1 stand-in whose /health answers 503, are unreachable
  with the reason and the timeout; one whose /health answers 200 is reachable.
The generation and weight sync go through TRL's VLLMClient, which needs vllm and a CUDA device: bench/gpu_check.sh
grpo_async_vllm runs them against a real `trl vllm-serve`.
"""

from __future__ import annotations

import json
import socket
import threading
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
