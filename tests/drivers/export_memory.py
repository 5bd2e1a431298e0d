"""Peak memory of one export, measured in a fresh process:
`python tests/drivers/export_memory.py CKPT OUT [SHARD] [DTYPE]` prints one JSON line.

Two high-water marks per phase, both relative to the process just before the phase (torch, transformers and
DeepSpeed already imported):
  vm_hwm_growth_bytes        Linux VmHWM after resetting it (echo 5 > /proc/self/clear_refs): every page the
                             process held at its peak, private or file-backed (mapped checkpoint pages count).
  rss_anon_peak_growth_bytes RssAnon (private memory only) sampled every millisecond by a thread.
Phases: "write" (plan + read + write the shards, config, tokenizer) and "verify" (load the folder, logits vs
probe.pt); "export" is export() as a whole, which is also all an older harness offers (WHOLE=1 measures only it).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from harness.profiling.proc import RssAnonPeak, reset_vm_hwm, status_bytes


def _status(field: str) -> int:
    return status_bytes(field)


class Peak:
    def __enter__(self):
        reset_vm_hwm()
        self.rss_start, self.anon_start = _status("VmRSS"), _status("RssAnon")
        self.sampler = RssAnonPeak(0.001)
        self.sampler.start()
        self.start_s = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.anon_peak = self.sampler.stop()
        self.result = {"vm_hwm_growth_bytes": _status("VmHWM") - self.rss_start,
                       "rss_anon_peak_growth_bytes": self.anon_peak - self.anon_start,
                       "seconds": round(time.perf_counter() - self.start_s, 2)}


def measure(ckpt: str, out: str, shard: str, dtype: str | None) -> dict:
    import deepspeed  # noqa: F401  (imported before measuring: its import is not the export's memory)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from harness.checkpoint.export import folder as ex
    from harness.config.defaults import PRECISION_DTYPES

    result: dict = {"baseline_rss_anon_bytes": _status("RssAnon")}
    if os.environ.get("WHOLE"):
        import inspect

        streamed = "max_shard_size" in inspect.signature(ex.export).parameters  # an older harness has no shards
        with Peak() as whole:
            ex.export(ckpt, out, **({"max_shard_size": shard, "dtype": dtype} if streamed else {}))
        return {**result, "export": whole.result, "rss_anon_peak_bytes": whole.anon_peak}
    ref = ex.find_checkpoint(ckpt)
    manifest = ref.manifest()
    name = dtype or ex.train_dtype(manifest)
    torch_dtype = getattr(torch, PRECISION_DTYPES[name])
    # Warm-up: the model class, DeepSpeed's pickled types and the tokenizer import once (~100 MB of modules,
    # whatever the model's size); measured apart as "imports".
    from transformers import AutoTokenizer

    from harness.checkpoint.export.ckpt_tensors import MappedFiles

    with Peak() as imports:
        ex.open_state(ref, manifest, MappedFiles()), ex.meta_model(ref), AutoTokenizer.from_pretrained(ref.ckpt_dir / "hf")
    Path(out).mkdir(parents=True)
    with Peak() as write:
        sizes = ex._write_folder(ref, manifest, Path(out), torch_dtype, shard)
    with Peak() as verify:
        diff = ex.verify(ref, Path(out), torch_dtype)
    largest_shard = max(p.stat().st_size for p in Path(out).glob("model*.safetensors"))
    return {**result, **sizes, "largest_shard_bytes": largest_shard, "max_logit_diff": diff,
            "imports": imports.result, "write": write.result, "verify": verify.result,
            "rss_anon_peak_bytes": max(p.anon_peak for p in (imports, write, verify))}


if __name__ == "__main__":
    args = sys.argv[1:] + [None] * (4 - len(sys.argv[1:]))
    print(json.dumps(measure(args[0], args[1], args[2] or "5GB", args[3])))
