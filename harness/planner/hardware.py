"""Hardware profiles as data: what the step-time model knows about one kind of node.

Named profiles live in harness/planner/profiles/NAME.json; `--hardware FILE` reads any file of the same
form (`harness calibrate` writes one for the machine it runs on). Every file is checked against
harness/schemas/hardware.schema.json, like recipes, and a bad one stops with the JSON path and the fix.
The schema says what each number means and its unit (GB/s = 10^9 bytes/s, bus bandwidth as nccl-tests
reports it, per GPU unless the key says per node).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from harness.config.schema import validate
from harness.errors import ConfigError, UsageError

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
SCHEMA = "hardware.schema.json"
DEFAULT_PROFILE = "a100-80gb-sxm"
ADAM_BYTES_PER_PARAM = 30  # fp32 param, grad, m, v read (16) + param, m, v written (12) + the 16-bit copy (2)


def names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def check(profile: dict, source: str) -> dict:
    problems = validate(profile, SCHEMA)
    if problems:
        raise ConfigError(problems, source)
    return profile


@cache
def _named(name: str) -> dict:
    path = PROFILE_DIR / f"{name}.json"
    return check(json.loads(path.read_text()), str(path))


def load(spec: str) -> dict:
    """A profile by name (harness/planner/profiles/) or from a JSON file (a copy: callers may edit it)."""
    if spec in names():
        return dict(_named(spec))
    path = Path(spec)
    if path.is_file():
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UsageError(f"--hardware {spec}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise UsageError(f"--hardware {spec}: expected a JSON object (a hardware profile)")
        return check(data, str(path))
    raise UsageError(f"--hardware {spec!r}: not a named profile and no such file; named profiles: "
                     f"{', '.join(names())}, or a JSON file written by `harness calibrate`")


def for_memory(gpu_mem_bytes: int) -> dict:
    """The named GPU profile whose memory is nearest `gpu_mem_bytes` (what `plan --gpu-mem` alone implies),
    A100-80GB on ties; the caller says which one it used."""
    gpus = [_named(n) for n in names() if _named(n)["device"] == "gpu"]
    return dict(min(gpus, key=lambda p: (abs(p["gpu_mem_bytes"] - gpu_mem_bytes), p["name"] != DEFAULT_PROFILE)))


def peak_flops(profile: dict, precision: str) -> float:
    """Dense peak FLOP/s of one device in this precision (bf16 falls back to fp16 and back)."""
    peaks = profile["peak_tflops"]
    value = peaks.get(precision) or peaks.get({"bf16": "fp16", "fp16": "bf16"}.get(precision, ""))
    if not value:
        raise UsageError(f"hardware profile {profile['name']} has no {precision} peak (peak_tflops: "
                         f"{', '.join(peaks)}); choose --precision {' or '.join(peaks)}")
    return value * 1e12


def achieved_flops(profile: dict, precision: str) -> float:
    return peak_flops(profile, precision) * profile["gemm_efficiency"]


def measured(profile: dict, key: str) -> dict:
    """One table of what `harness calibrate` measured ({} on a named profile, which has none)."""
    return (profile.get("measured") or {}).get(key, {})


def device_adam_params_per_s(profile: dict) -> float:
    return profile.get("device_adam_params_per_s") or profile["hbm_gbps"] * 1e9 / ADAM_BYTES_PER_PARAM


HARDWARE_ENV = "HARNESS_HARDWARE"  # NAME|FILE: the profile runs and --recipe auto use


def calibrated_path() -> Path:
    """Where `harness calibrate` writes by default, and where runs look for this machine's profile."""
    import os

    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsharness" / "hardware.json"


def for_machine(device: str, device_name: str, gpu_mem_bytes: int) -> tuple[dict | None, str]:
    """(profile, where it came from) for the machine a run is on: $HARNESS_HARDWARE, else the calibrated file when
    it was measured on this kind of device, else the named GPU profile matching the device's name and memory;
    (None, why) when there is none (the CPU accelerator before `harness calibrate`)."""
    import os

    if os.environ.get(HARDWARE_ENV):
        return load(os.environ[HARDWARE_ENV]), f"${HARDWARE_ENV}={os.environ[HARDWARE_ENV]}"
    path = calibrated_path()
    kind = "cpu" if device.startswith("cpu") else "gpu"
    if path.is_file():
        profile = load(str(path))
        if profile["device"] == kind and (kind == "cpu" or device_name in profile.get("description", "")):
            return profile, f"calibrated ({path})"
    if kind == "gpu":
        family = [n for n in names() if n.split("-")[0] in device_name.lower().replace(" ", "")]
        if family:
            best = min(family, key=lambda n: abs(_named(n)["gpu_mem_bytes"] - gpu_mem_bytes))
            return dict(_named(best)), f"named profile {best} (matched {device_name!r})"
    return None, f"no hardware profile for {device_name or device}: run `harness calibrate` (writes {path})"
