"""`harness calibrate`: measure the machine it runs on and write a hardware profile the step-time model uses.

What it measures, each with the real code path training uses:
- GEMM FLOP/s at the model's shapes (torch.matmul in the training precision, tokens = micro-batch x seq):
  the q/k/v/o, MLP and LM-head products of one block, timed on the device. The profile's peak is the
  datasheet's on a known GPU; on the CPU accelerator, where there is no fixed peak, the measured GEMM rate.
- Device memory bandwidth (a large tensor copy), which times the step's elementwise work and the optimizer.
- Forward + backward of the model cut to two blocks, at the same shapes: gemm_efficiency is the share of the
  GEMM peak at which the time model's compute term (planner/steptime.py) reproduces that measured time, so
  the profile carries what a real step achieves here (autograd, elementwise kernels, attention), not a guess.
  (Taken from one process: the same from the engine's ZeRO-0 step on every rank at once swung 0.64-0.75
  between calibrations here, the single process 0.61-0.67.) The engine's times give the optimizer rate per
  stage and the ZeRO residual (engine.py); those vary between calibrations on a shared machine by
  more than the model's other terms do.
- all_reduce, all_gather_into_tensor and reduce_scatter_tensor bus bandwidth per group size, over the
  backend DeepSpeed picks for this accelerator (NCCL on CUDA, gloo on CPU): comm.py.
- host <-> device copies from pinned memory (CUDA). On the CPU accelerator device memory IS host memory, so
  "offload" is a memcpy: that is what is measured and the profile says so.
- DeepSpeedCPUAdam parameters per second (the op ZeRO-Offload steps with), scaled to the node by the ranks
  that fit on its cores.
- NVMe write and read through DeepSpeed's async_io (the swapper's aio_handle) when the op loads; otherwise
  not measured, and the profile keeps a stated default.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.planner.shape import ModelShape

from harness.calibration.hooks import add_engine_rates
from harness.config.defaults import PRECISION_DTYPES

DEFAULT_NVME_GBPS = (2.0, 1.0)  # read, write: a SATA-class SSD, used only when async_io does not load


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def timeit(fn, device: str, repeat: int = 5, warmup: int = 1) -> float:
    """Median seconds of fn() on the device."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_shapes(shape: ModelShape, tokens: int) -> list[tuple[int, int, int, int]]:
    """(M, K, N, times per block forward) of the block's projections and the head (planner.params.model_shape)."""
    h, inter, v = shape.hidden_size, shape.intermediate_size, shape.vocab_size
    d_attn = shape.num_attention_heads * shape.head_dim
    kv = shape.num_key_value_heads * shape.head_dim
    mlp_in = 2 if shape.model_type != "gpt2" else 1  # gate and up (SwiGLU), or one fc
    return [(tokens, h, d_attn + 2 * kv, 1), (tokens, d_attn, h, 1), (tokens, h, inter, mlp_in),
            (tokens, inter, h, 1), (tokens, h, v, 0)]


def measure_gemm(shape: ModelShape, tokens: int, precision: str, device: str) -> dict:
    """Achieved FLOP/s over one block's GEMMs (weighted by their FLOPs, as a training step mixes them)."""
    import torch

    dtype = getattr(torch, PRECISION_DTYPES[precision])
    per_shape, flops, seconds = [], 0.0, 0.0
    for m, k, n, count in gemm_shapes(shape, tokens):
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        t = timeit(lambda: torch.matmul(a, b), device)
        f = 2.0 * m * k * n
        per_shape.append({"m": m, "k": k, "n": n, "tflops": f / t / 1e12})
        weight = max(count, 1) if count else 1.0 / max(shape.num_hidden_layers, 1)  # the head once per model
        flops, seconds = flops + weight * f, seconds + weight * t
    return {"tflops": flops / seconds / 1e12, "shapes": per_shape, "precision": precision, "tokens": tokens}


def measure_block_step(cfg: dict, seq_len: int, micro_batch: int, precision: str, device: str,
                       layers: int = 2) -> dict:
    """Forward + backward of the model cut to `layers` blocks (embedding, blocks, head, loss) at `tokens` per
    micro-batch: what a training step's math really achieves here, elementwise work and autograd included."""
    import torch

    from harness.calibration.engine import cut_model

    dtype = getattr(torch, PRECISION_DTYPES[precision])
    model = cut_model(cfg, layers).to(device=device, dtype=dtype)
    ids = torch.randint(0, model.config.vocab_size, (micro_batch, seq_len), device=device)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    return {"seconds": timeit(step, device, repeat=3), "layers": layers, "tokens": ids.numel(), "seq_len": seq_len}


def measure_masked_attention(shape: ModelShape, seq_len: int, micro_batch: int, precision: str, device: str) -> dict:
    """sdpa forward + backward with a materialised causal boolean mask over the same without a mask (is_causal),
    at the model's heads, head_dim and seq_len: what a run with document masks (sdpa, document_sdpa) pays per
    attention over the causal kernel measure_block_step times (planner/steptime.py)."""
    import torch

    dtype = getattr(torch, PRECISION_DTYPES[precision])
    q, k, v = (torch.randn(micro_batch, shape.num_attention_heads, seq_len, shape.head_dim, device=device,
                           dtype=dtype, requires_grad=True) for _ in range(3))
    mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()[None, None]

    def step(**kw):
        torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw).sum().backward()

    causal = timeit(lambda: step(is_causal=True), device, repeat=3)
    masked = timeit(lambda: step(attn_mask=mask), device, repeat=3)
    return {"causal_s": causal, "masked_s": masked, "factor": masked / causal, "seq_len": seq_len}


def block_efficiency(cfg: dict, block: dict, peak_tflops: float, hbm_gbps: float, precision: str) -> float:
    """The efficiency at which the time model's compute term (planner/steptime.py) reproduces the measured
    forward + backward: its FLOPs over (measured time - its memory-bound term) at the GEMM peak."""
    from harness.planner import steptime
    from harness.planner.inputs import Workload
    from harness.planner.params import count_params, model_shape

    from harness.calibration.engine import cut_config

    small = cut_config(cfg, block["layers"])
    count, shape = count_params(small), model_shape(small)
    work = Workload(block["seq_len"], block["tokens"] // block["seq_len"], precision)
    flops = 3 * block["tokens"] * (block["layers"] * steptime.block_flops_per_token(count, shape, block["seq_len"], 1)
                                   + steptime.head_flops_per_token(shape))
    elem = 3 * block["tokens"] * block["layers"] * steptime.elementwise_bytes_per_token(shape, work, 1) / (hbm_gbps * 1e9)
    math_s = max(block["seconds"] - elem, 0.1 * block["seconds"])
    return min(1.0, flops / math_s / (peak_tflops * 1e12))


def measure_memory_bw(device: str, nbytes: int = 256 * 2**20) -> float:
    import torch

    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    t = timeit(lambda: dst.copy_(src), device)
    return 2 * nbytes / t / 1e9  # read + write


def measure_host_copy(device: str, nbytes: int = 256 * 2**20) -> dict:
    """Pinned host <-> device GB/s (CUDA); on CPU the memcpy that stands in for it."""
    import torch

    if not device.startswith("cuda"):
        return {"gbps": measure_memory_bw("cpu", nbytes) / 2, "note": "n/a on the CPU accelerator: device memory "
                "is host memory, offload copies are memcpys (host copy bandwidth measured instead)"}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h2d = nbytes / timeit(lambda: dev.copy_(host, non_blocking=True), device) / 1e9
    d2h = nbytes / timeit(lambda: host.copy_(dev, non_blocking=True), device) / 1e9
    return {"gbps": min(h2d, d2h), "h2d_gbps": h2d, "d2h_gbps": d2h}


def measure_cpu_adam(numel: int = 4_000_000) -> dict:
    """DeepSpeedCPUAdam steps per second on `numel` fp32 parameters, this process's threads."""
    import torch
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    param = torch.nn.Parameter(torch.randn(numel))
    param.grad = torch.randn(numel)
    opt = DeepSpeedCPUAdam([param], lr=1e-3)
    t = timeit(opt.step, "cpu", repeat=5)
    return {"params_per_s_per_process": numel / t, "threads": torch.get_num_threads()}


def measure_nvme(folder: str, nbytes: int = 64 * 2**20) -> dict:
    """Write then read one file through async_io's aio_handle, as DeepSpeed's swapper does."""
    from deepspeed.ops.op_builder import AsyncIOBuilder
    import torch

    if not AsyncIOBuilder().is_compatible(verbose=False):
        return {"error": "async_io does not load here (libaio missing: apt install libaio-dev)"}
    handle = AsyncIOBuilder().load().aio_handle(1 << 20, 32, False, True, 1)
    buf = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    path = os.path.join(folder, f"harness-calibrate-{os.getpid()}.swp")
    try:
        start = time.perf_counter()
        handle.async_pwrite(buf, path, 0)
        handle.wait()
        os.sync()
        write = nbytes / (time.perf_counter() - start) / 1e9
        start = time.perf_counter()
        handle.async_pread(buf, path, 0)
        handle.wait()
        read = nbytes / (time.perf_counter() - start) / 1e9
    finally:
        handle.free_cpu_locked_tensor(buf)
        if os.path.exists(path):
            os.remove(path)
    return {"read_gbps": read, "write_gbps": write, "folder": folder,
            "note": "read right after write may come from the page cache: an upper bound"}


def _host() -> dict:
    import psutil

    return {"cores": os.cpu_count() or 1, "ram_bytes": psutil.virtual_memory().total, "hostname": platform.node()}


def _device() -> tuple[str, str, int]:
    """(device for tensors, its name, devices per node)."""
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu":
        return "cpu", "cpu", 0
    import torch

    return accel.device_name(0), torch.cuda.get_device_name(0), accel.device_count()


def _peak(device_name: str, precision: str, measured_tflops: float) -> tuple[float, float, str]:
    """(peak TFLOP/s, gemm efficiency, where the peak comes from)."""
    from harness.profiling.flops import peak_tflops

    peak, why = peak_tflops(device_name, precision)
    if peak is None:
        return measured_tflops, 1.0, f"no datasheet peak ({why}): the measured GEMM rate is the peak, efficiency 1"
    return peak, min(1.0, measured_tflops / peak), f"datasheet peak {peak} TFLOP/s (profiling/flops.py)"


def build_profile(cfg: dict, *, seq_len: int, micro_batch: int, precision: str, ranks: int | None,
                  nvme_path: str | None, name: str, log=print) -> dict:
    """Measure this machine and return a hardware profile (schema: harness/schemas/hardware.schema.json)."""
    from harness.planner.params import model_shape

    shape = model_shape(cfg)
    device, device_name, local = _device()
    host = _host()
    ranks = ranks or local or 2
    _share_cores(device, host, ranks)
    log(f"calibrating {device_name} x {ranks} ranks ({host['cores']} cores, {host['ram_bytes'] / 1e9:.0f} GB RAM)")
    gemm = measure_gemm(shape, seq_len * micro_batch, precision, device)
    log(f"  GEMM at the model's shapes: {gemm['tflops']:.3f} TFLOP/s ({precision})")
    hbm = measure_memory_bw(device)
    log(f"  device memory copy: {hbm:.1f} GB/s")
    block = measure_block_step(cfg, seq_len, micro_batch, precision, device)
    log(f"  forward + backward of {block['layers']} blocks + head: {block['seconds'] * 1e3:.1f} ms")
    masked = measure_masked_attention(shape, seq_len, micro_batch, precision, device)
    log(f"  sdpa with a materialised mask: {masked['factor']:.2f}x the causal kernel (forward + backward)")
    copy = measure_host_copy(device)
    log(f"  host<->device: {copy['gbps']:.1f} GB/s" + (f" ({copy['note']})" if "note" in copy else ""))
    adam, per_node = _cpu_adam(host, ranks, log)
    engine_args = {"cfg": cfg, "seq_len": seq_len, "micro_batch": micro_batch, "precision": precision}
    comm = _comm(ranks, precision, engine_args, device, device_name, log)
    nvme = measure_nvme(nvme_path or tempfile_dir())
    log("  NVMe (async_io): " + (nvme["error"] if "error" in nvme else
                                 f"write {nvme['write_gbps']:.2f} GB/s, read {nvme['read_gbps']:.2f} GB/s"))
    peak, _, peak_source = _peak(device_name, precision, gemm["tflops"])
    eff = block_efficiency(cfg, block, peak, hbm, precision)
    log(f"  efficiency of a training step's math: {eff:.2f} of {peak:.3g} TFLOP/s")
    largest = str(max(int(n) for n in comm["bus_gbps"]["all_reduce"]))
    latency = statistics.median(v for by in comm["latency_us"].values() for v in by.values())
    read, write = (DEFAULT_NVME_GBPS if "error" in nvme else (nvme["read_gbps"], nvme["write_gbps"]))
    gpu_mem = host["ram_bytes"] // ranks if device == "cpu" else _total_memory()
    profile = {
        "name": name, "description": f"measured by `harness calibrate` on {host['hostname']} ({device_name})",
        "device": "cpu" if device == "cpu" else "gpu", "gpu_mem_bytes": int(gpu_mem), "gpus_per_node": ranks,
        "peak_tflops": {precision: peak}, "gemm_efficiency": eff, "hbm_gbps": hbm,
        "masked_attention_factor": masked["factor"],
        **({"device_adam_params_per_s": adam["params_per_s_per_process"]} if device == "cpu" else {}),
        "intra_node_gbps": comm["bus_gbps"]["all_reduce"][largest], "inter_node_gbps": comm["bus_gbps"]["all_reduce"][largest],
        "intra_latency_us": latency, "inter_latency_us": latency, "pcie_gbps": copy["gbps"],
        "cpu_adam_params_per_s": per_node, "nvme_read_gbps": read, "nvme_write_gbps": write,
        "comm_overlap": device != "cpu",
        "measured": {"gemm": gemm, "block_step": block, "masked_attention": masked,
                     "memory_copy_gbps": hbm, "host_copy": copy, "cpu_adam": adam, "nvme": nvme,
                     "backend": comm["backend"], "bus_gbps": comm["bus_gbps"], "latency_us": comm["latency_us"],
                     "host": host, "model_tokens": seq_len * micro_batch},
        "source": f"harness calibrate, {time.strftime('%Y-%m-%d %H:%M')}: peak from {peak_source}; one node, so the "
                  "inter-node figures repeat the intra-node ones; on the CPU accelerator collectives do not overlap "
                  "compute (its streams are no-ops); NVMe " + ("not measured (" + nvme["error"] + "), a default"
                                                               if "error" in nvme else "via async_io"),
    }
    profile["measured"]["seconds_by_bytes"] = comm.get("seconds_by_bytes", {})
    if "engine" in comm:
        add_engine_rates(profile, cfg, comm["engine"], precision, ranks, log)
    return profile


def _share_cores(device: str, host: dict, ranks: int) -> None:
    """On the CPU each training rank gets its share of the cores: measure with that many threads."""
    if device == "cpu":
        import torch

        torch.set_num_threads(max(1, min(torch.get_num_threads(), host["cores"] // ranks)))


def _cpu_adam(host: dict, ranks: int, log) -> tuple[dict, float]:
    """DeepSpeedCPUAdam's rate per process, and per node (the ranks sharing the cores)."""
    adam = measure_cpu_adam()
    per_node = adam["params_per_s_per_process"] * min(ranks, max(1, host["cores"] // max(1, adam["threads"])))
    log(f"  DeepSpeedCPUAdam: {adam['params_per_s_per_process'] / 1e6:.1f} M params/s per process, "
        f"{per_node / 1e6:.1f} M/s per node")
    return adam, per_node


def _comm(ranks: int, precision: str, engine_args: dict, device: str, device_name: str, log) -> dict:
    """The collectives' curves over `ranks` processes and the engine's times (comm.measure); with one GPU the
    links of this GPU's named profile, saying so."""
    from harness.calibration.comm import measure as measure_comm

    comm = measure_comm(ranks, precision=precision, engine_args=engine_args)
    if "error" in comm:
        comm = _named_links(device, device_name, comm["error"])
    for op, by_size in comm["bus_gbps"].items():
        log(f"  {comm['backend']} {op}: " + ", ".join(f"{n} ranks {v:.2f} GB/s" for n, v in by_size.items()))
    return comm


def tempfile_dir() -> str:
    import tempfile

    return tempfile.gettempdir()


def _total_memory() -> int:
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().total_memory(0)


def _named_links(device: str, device_name: str, why: str) -> dict:
    """Collective figures from the named profile of this GPU when no collective can be timed (one rank)."""
    from harness.errors import UsageError
    from harness.planner import hardware

    named, _ = hardware.for_machine(device, device_name, 0) if device != "cpu" else (None, "")
    if named is None or named.get("name") == "calibrated":
        raise UsageError(f"calibrate: {why}; and no named profile for {device_name} to take link figures from")
    bw, lat = named["intra_node_gbps"], named["intra_latency_us"]
    return {"backend": f"not measured ({why}): {named['name']}'s figures",
            "bus_gbps": {op: {"8": bw} for op in ("all_reduce", "all_gather", "reduce_scatter")},
            "latency_us": {op: {"8": lat} for op in ("all_reduce", "all_gather", "reduce_scatter")}}
