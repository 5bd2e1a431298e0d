"""A teacher server for tests: a real tiny HF model behind the part of vLLM's OpenAI-compatible API that a served
teacher uses (GET /health, GET /v1/models, POST /v1/completions with token-id prompts and `prompt_logprobs`),
on 127.0.0.1, with plain http.server. Per position it returns the top-k of log_softmax(logits / temperature) and
the token actually there, each with its 1-based rank, as vLLM does.

    python -m tests.helpers.teacher_server --model DIR --port P [--stop-after N] [--hang-after N]

--stop-after N: the server ends after answering N completions requests (a server that dies mid-run);
--hang-after N: it accepts later requests and never answers them (a server that hangs).
In-process: `serve(model_dir)` returns a started server (`.server_address`, `.shutdown()`; not with --stop-after,
which ends the process); `start(model_dir, port, *flags)` runs it as a process of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch


def prompt_logprobs(model, ids: list[int], k: int, temperature: float) -> list:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logps = torch.log_softmax(logits / temperature, dim=-1)
    out = [None]
    for q in range(1, len(ids)):
        row = logps[q - 1]
        top = torch.topk(row, k)
        entry = {str(int(t)): {"logprob": float(v), "rank": r + 1, "decoded_token": ""}
                 for r, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()))}
        actual = ids[q]
        if str(actual) not in entry:
            entry[str(actual)] = {"logprob": float(row[actual]), "rank": int((row > row[actual]).sum()) + 1,
                                  "decoded_token": ""}
        out.append(entry)
    return out


def handler(model, name: str, stop_after: int | None, hang_after: int | None, state: dict):
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {})
            elif self.path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            else:
                self._send(404, {"error": self.path})

        def do_POST(self):
            if self.path != "/v1/completions":
                return self._send(404, {"error": self.path})
            with lock:
                state["answered"] += 1
                number = state["answered"]
            if hang_after is not None and number > hang_after:
                time.sleep(3600)
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if req.get("model") != name:
                return self._send(404, {"error": f"model {req.get('model')!r} does not exist"})
            prompts = req["prompt"]
            with lock:
                choices = [{"index": i, "text": "", "prompt_logprobs": prompt_logprobs(
                    model, p, int(req["prompt_logprobs"]), float(req.get("temperature", 1.0)))}
                    for i, p in enumerate(prompts)]
            self._send(200, {"object": "text_completion", "model": name, "choices": choices})
            if stop_after is not None and number >= stop_after:
                os._exit(0)  # the server dies mid-run

    return Handler


def serve(model_dir: str, port: int = 0, stop_after: int | None = None,
          hang_after: int | None = None) -> ThreadingHTTPServer:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    server = ThreadingHTTPServer(("127.0.0.1", port),
                                 handler(model, str(model_dir), stop_after, hang_after, {"answered": 0}))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def start(model_dir, port: int, *flags: str):
    """This server in a process of its own (for --stop-after / --hang-after), once it serves; kill it when done."""
    import subprocess
    import sys

    from tests.helpers.launch import ROOT, env

    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.teacher_server", "--model", str(model_dir),
                             "--port", str(port), *flags], cwd=ROOT, env=env(), stdout=subprocess.PIPE, text=True)
    assert "serving" in proc.stdout.readline()
    return proc


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stop-after", type=int)
    parser.add_argument("--hang-after", type=int)
    args = parser.parse_args()
    server = serve(args.model, args.port, args.stop_after, args.hang_after)
    print(f"serving {args.model} on 127.0.0.1:{server.server_address[1]}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
