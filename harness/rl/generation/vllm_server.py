"""rl.async with rl.vllm_mode server (rl.generator=vllm): the rollouts come from a vLLM server the user runs on GPUs
of its own (`trl vllm-serve`, which runs vLLM's `vllm serve` with TRL's weight-transfer settings), asked through
TRL's VLLMClient, instead of from a generator process per rank.

The schedule is AsyncGeneration's (harness/rl/async_rollouts.py; this class replaces its transport only):
- requests: each rank's rollouts of a step are asked in a background thread of its own, in order, while the
  trainer trains; one HTTP request per row with the row's seed row_seed(seed, global row) (vLLM's completions API
  takes one seed per request, so rows are not batched into one request; vLLM batches the concurrent ones itself);
  each row comes back with vLLM's log-prob of every sampled token (logprobs=0);
- weights: every rl.weight_sync_steps steps every rank first waits for the rollouts it has asked for (they were
  sampled on the version before), then all ranks walk the policy's weights in buckets of rl.sync_bucket_mb
  (gathered collectively under ZeRO-3, LoRA merged, as the colocated sync does) and global rank 0 streams each
  bucket to the server over NCCL (VLLMClient.update_named_params inside one weight_update), then resets the
  server's prefix cache. Rollouts asked after a sync carry its version (TRL's model_version).

World-size independence: a row's stream is its own seeded vLLM request, whichever rank asks it; the tokens are
the same on any world size only as far as vLLM's kernels are batch-invariant (the server batches the requests of
all ranks together; VLLM_BATCH_INVARIANT=1 on the server makes them so where vLLM supports it).

A server that is down, answers with an error, or is silent past rl.async_timeout_s ends the run on every rank with
the reason (async_rollouts.raise_if_failed), as a generator process's failure does.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import nullcontext

import torch

from harness.rl.async_rollouts import PEFT_PREFIX, AsyncGeneration
from harness.rl.generation.gather import gathered_bytes, is_zero3
from harness.rl.generation.sampling import row_seed
from harness.rl.generation.vllm import bucket_params, buckets, merged, named_weights

DEFAULT_HOST, DEFAULT_PORT, DEFAULT_TIMEOUT_S = "0.0.0.0", 8000, 240.0  # TRL GRPOConfig's vllm_server_* defaults
DEFAULT_GROUP_PORT = 51216  # TRL's vllm_group_port
ROW_CONCURRENCY = 32  # rows of a step in flight at once per rank
SERVE = "CUDA_VISIBLE_DEVICES=<its GPUs> trl vllm-serve --model <train.model> --port 8000 (docs/rl.md)"


def server_url(rl: dict) -> str:
    """TRL's resolution: rl.vllm_server_base_url when set (host and port ignored), else http://host:port."""
    base = rl.get("vllm_server_base_url")
    if base:
        return str(base).rstrip("/")
    return f"http://{rl.get('vllm_server_host', DEFAULT_HOST)}:{int(rl.get('vllm_server_port', DEFAULT_PORT))}"


def unreachable(url: str, timeout_s: float, retry_s: float = 2.0) -> str | None:
    """Why the server at `url` does not answer GET /health with 200 within timeout_s (TRL's check_server), or None."""
    import requests

    deadline, last = time.monotonic() + float(timeout_s), ""
    while True:
        try:
            response = requests.get(f"{url}/health", timeout=max(min(retry_s, timeout_s), 0.5))
            if response.status_code == 200:
                return None
            last = f"GET {url}/health answered {response.status_code}"
        except requests.RequestException as e:
            last = f"GET {url}/health raised {type(e).__name__}"
        if time.monotonic() + retry_s > deadline:
            return f"the vLLM server at {url} does not answer ({last}) within rl.vllm_server_timeout = {timeout_s:g} s"
        time.sleep(retry_s)


def server_problem(rl: dict, cuda: bool) -> str | None:
    """Why rl.async's vLLM server mode cannot run from here (`cuda`: whether the ranks train on CUDA), or None. The
    cheap reasons first; the server is asked last."""
    import importlib.util

    if not cuda:
        return ("rl.vllm_mode server: the weights go to the server over NCCL from the trainer's CUDA device (TRL's "
                "weight-transfer engine), and the ranks here do not train on CUDA")
    for package, why in (("vllm", "TRL's VLLMClient needs the vllm package on every trainer rank"),
                         ("trl", "the client is TRL's VLLMClient (trl.generation.vllm_client)")):
        if importlib.util.find_spec(package) is None:
            return f"rl.vllm_mode server: {why}, and {package} is not installed"
    return unreachable(server_url(rl), float(rl.get("vllm_server_timeout", DEFAULT_TIMEOUT_S)))


def sampling_kwargs(rl: dict) -> dict:
    """VLLMClient.generate's sampling arguments from TRL's rl keys (top_k None or 0: off)."""
    return {"n": 1, "max_tokens": int(rl.get("max_completion_length", 256)),
            "temperature": float(rl.get("temperature", 1.0)), "top_p": float(rl.get("top_p") or 1.0),
            "top_k": int(rl.get("top_k") or 0), "logprobs": 0}


class ServerGeneration(AsyncGeneration):
    """AsyncGeneration's schedule with the server as the generator: request(step) -> (prompt_ids, seed, first_row)."""

    def _start(self, tokenizer):
        from trl.generation.vllm_client import VLLMClient

        self.main = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        self.sampling = sampling_kwargs(self.rl)
        self.client = None
        try:  # a failure here is said by every rank at the first take, not raised on this rank alone
            self.client = VLLMClient(base_url=server_url(self.rl), group_port=int(self.rl.get(
                "vllm_group_port", DEFAULT_GROUP_PORT)), connection_timeout=float(self.rl["vllm_server_timeout"]))
            if self.main:
                self.client.init_communicator(device=self.engine.device)
        except Exception as e:  # noqa: BLE001
            self._fail(f"connecting to it (and, on rank 0, joining its weight-transfer group) raised "
                       f"{type(e).__name__}: {e}")
        self._start_thread()
        return None, None

    def _start_thread(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.done = threading.Condition()
        self.pending = 0
        threading.Thread(target=self._serve, name=f"harness-vllm-client-rank{self.rank}", daemon=True).start()

    # --- the background thread: one step's rows at a time, in order ---
    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            step, version, prompt_ids, seed, first_row = job
            began = time.perf_counter()
            try:
                rows = self._rows(prompt_ids, [row_seed(seed, first_row + i) for i in range(len(prompt_ids))])
                answer = (version, [r[0] for r in rows], [r[1] for r in rows], time.perf_counter() - began, 0)
            except Exception as e:  # noqa: BLE001 - the trainer ends the run with this text
                answer, why = None, f"asking the rollouts of step {step + 1} raised {type(e).__name__}: {e}"
            with self.done:
                if answer is None:
                    self._fail(why)
                else:
                    self.results[step] = answer
                self.pending -= 1
                self.done.notify_all()

    def _rows(self, prompts: list, seeds: list[int]) -> list[tuple]:
        """The rows' requests, up to ROW_CONCURRENCY at once, on daemon threads (a request that never returns must
        not hold the process at exit, as a ThreadPoolExecutor's workers would); the first error is raised."""
        out, errors, todo = [None] * len(prompts), [], iter(range(len(prompts)))
        lock = threading.Lock()

        def work():
            while not errors:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    out[i] = self._row(prompts[i], seeds[i])
                except Exception as e:  # noqa: BLE001 - raised below, in the client thread
                    errors.append(e)

        threads = [threading.Thread(target=work, daemon=True) for _ in range(min(ROW_CONCURRENCY, len(prompts)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    def _row(self, prompt: list[int], seed: int) -> tuple[list[int], list[float]]:
        out = self.client.generate([list(prompt)], **self.sampling, generation_kwargs={"seed": seed})
        return list(out["completion_ids"][0]), [position[0] for position in (out["logprobs"] or [[]])[0]]

    # --- AsyncGeneration's transport ---
    def _send(self, message) -> None:
        if self.failure is None and message[0] == "generate":
            with self.done:
                self.pending += 1
            self.jobs.put((message[1], self.synced, *message[2:]))

    def _wait(self, step: int) -> tuple:
        deadline = time.monotonic() + self.timeout_s
        with self.done:
            while self.failure is None and step not in self.results:
                if not self.done.wait(timeout=max(deadline - time.monotonic(), 0)) and time.monotonic() >= deadline:
                    self._fail(f"no rollouts for step {step + 1} within rl.async_timeout_s = {self.timeout_s:g} s")
            return self.results.pop(step, (step, [], [], 0.0, 0))

    def _drain(self) -> None:
        """Wait for the rollouts asked so far (on the weights before the sync), within rl.async_timeout_s."""
        deadline = time.monotonic() + self.timeout_s
        with self.done:
            while self.failure is None and self.pending:
                if not self.done.wait(timeout=max(deadline - time.monotonic(), 0)) and time.monotonic() >= deadline:
                    self._fail(f"rollouts still pending after rl.async_timeout_s = {self.timeout_s:g} s")

    @torch.no_grad()
    def sync(self, version: int) -> None:
        """Every rank: its asked rollouts back, then the buckets walked (collective under ZeRO-3); rank 0 streams them
        to the server. A rank that failed keeps walking so the others' gathers complete."""
        self._drain()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank's requests in flight while the server's weights change
        began, module = time.perf_counter(), self.engine.module
        groups = buckets(list(named_weights(module)), self.bucket_bytes)
        send, sent = self.main and self.failure is None, None
        try:
            with self.client.weight_update() if send else nullcontext():
                sent = self._walk(groups, module, send)
            if send and self.failure is None:
                self.client.reset_prefix_cache()
        except Exception as e:  # noqa: BLE001 - raised outside a bucket's send: the run ends at the next take
            self._fail(f"the weight sync of version {version} raised {type(e).__name__}: {e}")
        if sent is None:  # it failed before walking: walk all the same, the other ranks are in the gathers
            sent = self._walk(groups, module, False)
        self.synced = version
        self.last_sync = {"seconds": time.perf_counter() - began, "bytes": sent, "buckets": len(groups)}

    def _walk(self, groups: list, module, send: bool) -> int:
        """The buckets gathered in turn (every rank), sent by rank 0 (`send`); the gathered bytes."""
        import deepspeed

        sent = 0
        for bucket in groups:
            params = bucket_params(bucket)
            with deepspeed.zero.GatheredParameters(params, enabled=is_zero3(module)):
                if send and self.failure is None:
                    self._send_bucket([(n.removeprefix(PEFT_PREFIX), merged(w, lora)) for n, w, lora in bucket])
            sent += sum(map(gathered_bytes, params))
        return sent

    def _send_bucket(self, tensors: list) -> None:
        try:
            metadata = [(n, str(t.dtype).removeprefix("torch."), list(t.shape)) for n, t in tensors]
            self.client.update_named_params(metadata, iter(tensors))
        except Exception as e:  # noqa: BLE001 - keep walking the buckets: the other ranks are in the gathers
            self._fail(f"sending weights to it raised {type(e).__name__}: {e}")

    def _fail(self, why: str) -> None:
        if self.failure is None:
            self.failure = (f"rank {self.rank}: rl.async's vLLM server at {server_url(self.rl)} failed: {why}\n"
                            "    fix: check the server's log (is it up, on the same model, started by trl "
                            "vllm-serve with its weight-transfer engine?); the run is not restarted, resume it from "
                            "its last checkpoint")

    def close(self) -> None:
        """Stop the client thread and leave the weight-transfer group."""
        if getattr(self, "jobs", None) is None:
            return
        self.jobs.put(None)
        self.jobs = None
        if self.main and self.client is not None:
            self.client.close_communicator()
