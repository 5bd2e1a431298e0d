"""MoE folders as transformers 5.24 saves them, read as the fused expert tensors the model holds.

save_pretrained writes a MoE block's routed experts one tensor per expert (<block>.experts.<e>.gate_proj.weight
[I, H], up_proj, down_proj [H, I]; Mixtral: <layer>.block_sparse_moe.experts.<e>.w1/w3/w2.weight, its router under
block_sparse_moe.gate) while the model trains transformers' fused <block>.experts.gate_up_proj [E, 2I, H] (gate rows
first) and down_proj [E, H, I]; from_pretrained fuses them (transformers/conversion_mapping.py: MergeModulelist
then Concatenate(dim=1) for qwen2_moe, which Qwen3-MoE, OLMoE and DeepSeek-V3 reuse, and mixtral). FusedExperts
puts that mapping in front of a checkpoint source, so the build by module (ZeRO-3, zero3.py) and its key check see
the model's names: a fused tensor is assembled expert by expert into one tensor (read in chunks of at most
CHUNK_BYTES, so rank 0 holds the fused tensor plus one chunk), everything else is read as stored. A folder stored
fused already (gpt-oss, or a folder `harness export` wrote) has no per-expert keys and is read unchanged.
"""

from __future__ import annotations

import re

import torch

from harness.model.load.slices import Request

PER_EXPERT = re.compile(r"^(?P<block>.+)\.experts\.(?P<e>\d+)\.(?P<w>[^.]+)\.weight$")
NAMES = {"mixtral": ("w1", "w3", "w2")}  # (gate, up, down) per expert in the file; the rest: gate/up/down_proj
DEFAULT_NAMES = ("gate_proj", "up_proj", "down_proj")
RENAMES = {"mixtral": (".block_sparse_moe.", ".mlp.")}  # file -> model, as conversion_mapping's WeightRenaming
CHUNK_BYTES = 64 << 20


class FusedExperts:
    """A source (source.CheckpointFiles) whose per-expert keys read as the model's fused tensors."""

    def __init__(self, source, model_type: str):
        self.source, self.where = source, source.where
        gate, up, down = NAMES.get(model_type, DEFAULT_NAMES)
        old, new = RENAMES.get(model_type, ("", ""))
        rename = (lambda key: key.replace(old, new)) if old else (lambda key: key)
        blocks: dict[str, dict[str, dict[int, str]]] = {}
        self.plain: dict[str, str] = {}  # model key -> file key
        for key in source.keys():
            m = PER_EXPERT.match(key)
            if m and m["w"] in (gate, up, down):
                blocks.setdefault(rename(m["block"] + ".")[:-1], {}).setdefault(m["w"], {})[int(m["e"])] = key
            else:
                self.plain[rename(key)] = key
        self.fused: dict[str, list[tuple[str, ...]]] = {}  # model key -> per expert, the file keys fused
        for block, parts in blocks.items():
            count = len(parts.get(gate, {}))
            if any(sorted(parts.get(w, {})) != list(range(count)) for w in (gate, up, down)):
                raise ValueError(f"{self.where}: {block}.experts holds an incomplete set of per-expert tensors "
                                 f"({ {w: sorted(parts.get(w, {})) for w in (gate, up, down)} })")
            self.fused[f"{block}.experts.gate_up_proj"] = [(parts[gate][e], parts[up][e]) for e in range(count)]
            self.fused[f"{block}.experts.down_proj"] = [(parts[down][e],) for e in range(count)]

    def keys(self) -> set[str]:
        return set(self.plain) | set(self.fused)

    def file_of(self, key: str) -> str:
        return self.source.file_of(self.fused[key][0][0] if key in self.fused else self.plain[key])

    def dtype(self) -> str | None:
        return self.source.dtype()

    def read(self, requests: dict[str, Request], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        plain = {self.plain[k]: r for k, r in requests.items() if k not in self.fused}
        back = {self.plain[k]: k for k in requests if k not in self.fused}
        out = {back[k]: v for k, v in self.source.read(plain, dtype).items()} if plain else {}
        for key in (k for k in requests if k in self.fused):
            if requests[key].dim is not None:
                raise ValueError(f"{key}: fused experts are read whole (tensor parallel does not split them)")
            out[key] = self._fuse(self.fused[key], dtype)
        return out

    def _fuse(self, experts: list[tuple[str, ...]], dtype) -> torch.Tensor:
        """[E, sum of the parts' rows, H]: each expert's parts concatenated along rows (gate then up), stacked."""
        first = self.source.read({k: Request() for k in experts[0]}, dtype)
        parts = [first.pop(k) for k in experts[0]]
        out = torch.empty((len(experts), sum(p.shape[0] for p in parts), parts[0].shape[1]), dtype=parts[0].dtype)
        torch.cat(parts, dim=0, out=out[0])
        del parts
        step = max(1, CHUNK_BYTES // (out[0].numel() * out.element_size()))
        for start in range(1, len(experts), step):
            chunk = experts[start:start + step]
            values = self.source.read({k: Request() for names in chunk for k in names}, dtype)
            for e, names in enumerate(chunk, start):
                torch.cat([values.pop(k) for k in names], dim=0, out=out[e])
        return out


def fused_view(source, model_config):
    """`source` with per-expert keys read as fused tensors when it stores them so (MoE folders); else itself."""
    view = FusedExperts(source, getattr(model_config, "model_type", ""))
    return view if view.fused else source
