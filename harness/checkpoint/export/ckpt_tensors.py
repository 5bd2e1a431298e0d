"""A DeepSpeed checkpoint's weights as lazy tensors: name -> (shape, a function reading that one tensor).

Nothing is read whole. Rank files are opened with torch.load(mmap=True): the file is mapped, so slicing one
parameter out of a partition touches only that parameter's pages, and those are file-backed (page cache), not
this process's private memory. Layouts (the partition rules are DeepSpeed's deepspeed/utils/zero_to_fp32.py):

  ZeRO-0     mp_rank_XX_model_states.pt "module": whole weights in the training dtype.
  ZeRO-1/2   each dp rank's *_optim_states.pt holds single_partition_of_fp32_groups[g]: its contiguous piece of
             param group g's flat fp32 vector; the whole vector is the ranks' pieces in dp order, the group's
             parameters laid end to end in param_shapes[g] order, each followed by its param_alignment_padding.
  ZeRO-3     each dp rank's fp32_flat_groups (concatenated) hold ceil(numel / dp) elements of every parameter, in
             param_shapes order; the parameter is the ranks' slices in dp order, cut to numel (tail padding).
  frozen     (requires_grad False) parameters: frozen_param_fragments in the model-states files (ZeRO-3: per-rank
             slices as above), not in the optimizer's groups.
  shared     shared_params {name: source}: one tensor under two names (a tied LM head).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from harness.errors import UsageError

FILE_BUDGET_BYTES = 256 << 20  # after this much is read, maps are dropped so touched pages leave this process


@dataclass(frozen=True)
class Lazy:
    shape: tuple[int, ...]
    read: Callable[[], torch.Tensor]  # the whole tensor, as stored (a view of a mapped file where it can be)
    # the whole tensor cast to a dtype, assembled in that dtype: a gathered fp32 tensor exported as bf16 is then
    # never held in fp32 as well (ZeRO-3's per-rank slices); None: read() then cast
    read_as: Callable[[torch.dtype], torch.Tensor] | None = None


def _enum_member(cls, name: str):
    """What pickle's `getattr(cls, name)` may do in a checkpoint: name a member of an allowed enum, nothing else.
    Python 3.11.0-3.11.4 pickle enum members (ZeroStageEnum in DeepSpeed's optimizer states) as a call to the
    builtin getattr; allowing the builtin itself would let a file reach any attribute."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    if cls is ZeroStageEnum and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise UsageError(f"a checkpoint file asks for getattr({cls!r}, {name!r}): only ZeroStageEnum members are "
                     "allowed\n    fix: export only checkpoints written by DeepSpeed through this harness")


def _safe_globals() -> list:
    """The non-tensor types DeepSpeed pickles into optimizer states, allowed for a weights_only load."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, (_enum_member, "builtins.getattr")]


class MappedFiles:
    """torch.load(path, mmap=True, weights_only=True) per file, cached until FILE_BUDGET_BYTES are read: then
    every map is dropped (unmapped once no tensor views it), so the pages read stay bounded as well."""

    def __init__(self, budget_bytes: int = FILE_BUDGET_BYTES):
        self.budget_bytes, self.read_bytes = budget_bytes, 0
        self._open: dict[Path, dict] = {}

    def __getitem__(self, path: Path) -> dict:
        if path not in self._open:
            with torch.serialization.safe_globals(_safe_globals()):
                self._open[path] = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        return self._open[path]

    def count(self, nbytes: int) -> None:
        self.read_bytes += nbytes
        if self.read_bytes > self.budget_bytes:
            self._open.clear()
            self.read_bytes = 0


def _read_range(pieces: list[torch.Tensor], start: int, numel: int) -> torch.Tensor:
    """Elements [start, start + numel) of the concatenation of 1-D `pieces`, copying only that range."""
    chunks, offset = [], 0
    for piece in pieces:
        lo, hi = max(start, offset), min(start + numel, offset + piece.numel())
        if lo < hi:
            chunks.append(piece.narrow(0, lo - offset, hi - lo))
        offset += piece.numel()
    if sum(c.numel() for c in chunks) != numel:
        raise UsageError(f"checkpoint partitions hold {offset} elements, too few for [{start}, {start + numel})"
                         "\n    fix: the checkpoint is incomplete or not DeepSpeed's layout; export another one")
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def _numel(shape) -> int:
    return math.prod(shape)


def _counted(files: MappedFiles, read: Callable[[], torch.Tensor]) -> torch.Tensor:
    tensor = read()
    files.count(tensor.numel() * tensor.element_size())
    return tensor


def lazy(files: MappedFiles, shape, read: Callable[[], torch.Tensor]) -> Lazy:
    return Lazy(tuple(shape), partial(_counted, files, read))


def _dp_rank(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def rank_files(tag_dir: Path, kind: str, mp_rank: int) -> list[Path]:
    """One tensor rank's per-dp-rank files ("optim" or "model"), in dp-rank order."""
    found = tag_dir.glob(f"*zero_pp_rank_*_mp_rank_{mp_rank:02d}_{kind}_states.pt")
    return sorted(found, key=_dp_rank)


def _module_entries(files: MappedFiles, path: Path, names) -> dict[str, Lazy]:
    module = files[path]["module"]
    return {name: lazy(files, module[name].shape, lambda p=path, n=name: files[p]["module"][n]) for name in names}


def zero0_source(files: MappedFiles, tag_dir: Path, mp_rank: int) -> dict[str, Lazy]:
    path = tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"
    return _module_entries(files, path, list(files[path]["module"]))


def _optim_paths(tag_dir: Path, mp_rank: int) -> list[Path]:
    paths = rank_files(tag_dir, "optim", mp_rank)
    if not paths:
        raise UsageError(f"{tag_dir}: no *_mp_rank_{mp_rank:02d}_optim_states.pt files (a ZeRO checkpoint without "
                         "its optimizer states)\n    fix: export a checkpoint whose save finished")
    return paths


def _check_count(files: MappedFiles, paths: list[Path]) -> None:
    count = files[paths[0]]["optimizer_state_dict"]["partition_count"]
    count = max(count) if isinstance(count, list) else count
    if count != len(paths):
        raise UsageError(f"{paths[0].parent}: {len(paths)} optimizer-state files for a data-parallel world of "
                         f"{count}\n    fix: the save did not finish on every rank; export another checkpoint")


def _extras(files: MappedFiles, model_path: Path, out: dict[str, Lazy]) -> None:
    """Buffers from the module, then shared names (a tied head points at its source tensor)."""
    states = files[model_path]
    out.update(_module_entries(files, model_path, [b for b in states["buffer_names"] if b in states["module"]]))
    for name, source in states["shared_params"].items():
        if source in out:
            out[name] = out[source]


def zero12_source(files: MappedFiles, tag_dir: Path, mp_rank: int) -> dict[str, Lazy]:
    key = "single_partition_of_fp32_groups"
    paths = _optim_paths(tag_dir, mp_rank)
    _check_count(files, paths)
    model_path = tag_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"
    states, optim = files[model_path], files[paths[0]]["optimizer_state_dict"]
    paddings = optim.get("param_alignment_paddings")
    out: dict[str, Lazy] = {}
    for name, shape in (states.get("frozen_param_shapes") or {}).items():
        out[name] = lazy(files, shape, lambda n=name: files[model_path]["frozen_param_fragments"][n])
    for group, shapes in enumerate(states["param_shapes"]):
        offset = 0
        for index, (name, shape) in enumerate(shapes.items()):
            def read(g=group, start=offset, shape=tuple(shape)):
                pieces = [files[p]["optimizer_state_dict"][key][g] for p in paths]
                return _read_range(pieces, start, _numel(shape)).view(shape)
            out[name] = lazy(files, shape, read)
            offset += _numel(shape) + (paddings[group][index] if paddings else 0)
    _extras(files, model_path, out)
    return out


def zero3_offsets(states: dict, partition_size: Callable[[str], int]) -> dict[str, tuple[int, int, tuple]]:
    """{name: (start in the rank's concatenated fp32_flat_groups, elements per rank, shape)}: each parameter holds
    ceil(numel / its partition group's size) elements on every rank (the dp world; AutoEP's experts: their
    expert-data-parallel group), in param_shapes order."""
    out, offset = {}, 0
    for name, shape in ((n, s) for group in states["param_shapes"] for n, s in group.items()):
        per_rank = math.ceil(_numel(shape) / partition_size(name))
        out[name] = (offset, per_rank, tuple(shape))
        offset += per_rank
    return out


def zero3_gathered(files: MappedFiles, paths: list[Path], start: int, per_rank: int, shape) -> Lazy:
    """One ZeRO-3 parameter: the `paths` ranks' slices [start, start + per_rank) in partition-rank order, cut to
    numel (tail padding), assembled in the dtype asked for."""
    numel = _numel(shape)

    def slices() -> list[torch.Tensor]:
        return [_read_range(files[p]["optimizer_state_dict"]["fp32_flat_groups"], start, per_rank) for p in paths]

    def gathered_as(dtype) -> torch.Tensor:
        out, offset = torch.empty(numel, dtype=dtype), 0
        for piece in slices():
            take = min(piece.numel(), numel - offset)
            if take > 0:
                out.narrow(0, offset, take).copy_(piece.narrow(0, 0, take))
                files.count(take * piece.element_size())
            offset += take
        return out.view(shape)

    def gathered() -> torch.Tensor:
        return torch.cat(slices()).narrow(0, 0, numel).view(shape)

    return Lazy(tuple(shape), partial(_counted, files, gathered), gathered_as)


def zero3_source(files: MappedFiles, tag_dir: Path, mp_rank: int,
                 partition_size: Callable[[str], int] | None = None,
                 leave_out: Callable[[str], bool] = lambda name: False) -> dict[str, Lazy]:
    """partition_size(name): its partition group's size (default: the dp world); leave_out(name): not returned."""
    paths, models = _optim_paths(tag_dir, mp_rank), rank_files(tag_dir, "model", mp_rank)
    _check_count(files, paths)
    world, states = len(paths), files[models[0]]
    size_of = partition_size or (lambda name: world)
    out: dict[str, Lazy] = {}
    for name, shape in (states.get("frozen_param_shapes") or {}).items():
        out[name] = lazy(files, shape, lambda n=name, s=tuple(shape): torch.cat(
            [files[m]["frozen_param_fragments"][n].reshape(-1) for m in models]).narrow(0, 0, _numel(s)).view(s))
    for name, (start, per_rank, shape) in zero3_offsets(states, size_of).items():
        if not leave_out(name):
            out[name] = zero3_gathered(files, paths, start, per_rank, shape)
    _extras(files, models[0], out)
    return out


def zero_source(files: MappedFiles, tag_dir: Path, zero_stage: int, mp_rank: int) -> dict[str, Lazy]:
    """One tensor rank's weights (fp32 masters for ZeRO-1/2/3), lazily, under the engine module's names."""
    if zero_stage == 0:
        return zero0_source(files, tag_dir, mp_rank)
    return zero3_source(files, tag_dir, mp_rank) if zero_stage == 3 else zero12_source(files, tag_dir, mp_rank)
