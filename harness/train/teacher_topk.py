"""The top-k teachers of a distillation run (distill.teacher_mode precomputed, served): what harness/train/teacher.py
builds for them and what they answer per micro-batch (harness/train/distill_loss.Targets of kind "topk": ids [N, k]
int64, log-probs [N, k] float32 and the actual token's log-prob [N] at the loss temperature).

precomputed  the teacher's top-k for every record, written once before the student is built (a frozen teacher engine
             built by the reference's machinery, one micro-batch per rank, then freed: harness/distill/
             teacher_store.py) into a folder under train.store_dir keyed by the teacher, the records' tokens, the
             tokenizer, seq_len, k, the temperature and the precision; a second run with the same key reads it and
             builds no teacher. A batch's rows are looked up by their record numbers (the batch's fourth tensor: harness/train/distill.py).
served       distill.teacher_model_server_url asked per micro-batch (harness/distill/served.py). A rank whose request
             fails after its retries tells the others (one all-gather of the error per micro-batch), so every rank
             ends with that reason and its exit code (69 an outage, 2 a refused or malformed answer) instead of
             waiting in a collective for a rank that left.
"""

from __future__ import annotations

import gc
import hashlib
import time
from pathlib import Path

import torch

from harness.config.distill_rules import settings
from harness.data.rows import IGNORE_INDEX
from harness.data.store import DEFAULT_ROOT, tokenizer_hash
from harness.distill.served import ServedTeacher, TeacherServerError, TeacherUnavailable
from harness.distill.teacher_store import ensure_teacher_store, store_key, store_path
from harness.distill.topk import TopK, teacher_topk
from harness.train.distill_loss import Targets
from harness.train.reference_cache import weights_fingerprint
from harness.train.reference_engine import build_engine, reference_name


def _targets(answer: TopK, input_ids: torch.Tensor, where: torch.Tensor) -> Targets:
    return Targets(ids=answer.ids, logprobs=answer.logps, actual=answer.actual,
                   tokens=input_ids[:, 1:][where.to(input_ids.device)].cpu())


def labels_at(input_ids: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Labels [B, L] with the tokens at the loss positions `where` ([B, L - 1]: labels[:, 1:] != -100)."""
    labels = torch.full_like(input_ids, IGNORE_INDEX)
    labels[:, 1:][where] = input_ids[:, 1:][where]
    return labels


class PrecomputedTeacher:
    mode = "precomputed"

    def __init__(self, store):
        self.store = store

    def targets(self, student, input_ids: torch.Tensor, where: torch.Tensor, ids: torch.Tensor) -> Targets:
        return _targets(self.store.rows(ids.numpy()), input_ids, where)


class ServedTargets:
    mode = "served"

    def __init__(self, client: ServedTeacher):
        self.client = client

    def targets(self, student, input_ids: torch.Tensor, where: torch.Tensor, ids=None) -> Targets:
        answer, error = None, None
        try:
            answer = self.client(input_ids.cpu(), labels_at(input_ids.cpu(), where.cpu()))
        except (TeacherServerError, TeacherUnavailable) as err:
            error = (type(err).__name__, str(err))
        failed = _first_failure(error)
        if failed is not None:
            kind, text = failed
            raise (TeacherUnavailable if kind == TeacherUnavailable.__name__ else TeacherServerError)(text)
        return _targets(answer, input_ids, where)


def _first_failure(error: tuple[str, str] | None) -> tuple[str, str] | None:
    """The first rank's (error class, message; its rank named when there are several), or None when every rank had
    its answer."""
    import torch.distributed as tdist

    if not (tdist.is_initialized() and tdist.get_world_size() > 1):
        return error
    errors = [None] * tdist.get_world_size()
    tdist.all_gather_object(errors, error)
    return next(((e[0], f"rank {rank}: {e[1]}") for rank, e in enumerate(errors) if e is not None), None)


def _store_key(spec, records, tokenizer) -> dict:
    cfg, train = settings(spec.recipe), spec.recipe["train"]
    rows = hashlib.sha256(records.tokens.tobytes() + records.bounds.tobytes()).hexdigest()
    data = {"dataset": train["dataset"], "rows_digest": rows, "records": len(records.tokens),
            "tokenizer_hash": tokenizer_hash(tokenizer, with_template=True), "seq_len": train["seq_len"]}
    name = reference_name(spec)
    return store_key(teacher=name, weights=weights_fingerprint(name, train["seed"]), data=data,
                     k=cfg["loss_top_k"], temperature=cfg["loss_temperature"], precision=spec.run.precision)


def precomputed(spec, records, tokenizer) -> tuple[PrecomputedTeacher, str]:
    """(the teacher, its start-up line): the store read, or written by a teacher engine that is freed after."""
    cfg = settings(spec.recipe)
    key = _store_key(spec, records, tokenizer)
    root = Path(spec.recipe["train"]["store_dir"] or DEFAULT_ROOT).expanduser()
    path = store_path(root / "teachers", key)
    built = {}

    def teacher(input_ids, labels):
        if "engine" not in built:
            built["engine"] = build_engine(spec)[0]
        engine = built["engine"]
        logits = engine(input_ids=input_ids.to(engine.device), use_cache=False).logits
        return teacher_topk(logits, labels, cfg["loss_top_k"], cfg["loss_temperature"])

    def batch(row_ids):
        return records[row_ids].tensors()[:2]

    started = time.perf_counter()
    with torch.no_grad():
        store, written = ensure_teacher_store(path, key, num_rows=len(records), batch=batch, teacher=teacher,
                                              micro=spec.run.batch.micro_batch, vocab_size=len(tokenizer))
    if "engine" in built:
        built["engine"].destroy()
        built.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the student's engine is built next
    meta = store.meta
    mib = meta["tokens"] * meta["bytes_per_token"] / 2**20
    how = (f"written in {time.perf_counter() - started:.2f}s by a teacher engine of {reference_name(spec)}, then "
           "freed" if written else "read, no teacher built")
    return PrecomputedTeacher(store), (
        f"teacher: precomputed top-{cfg['loss_top_k']} of {reference_name(spec)} at T {cfg['loss_temperature']:g}: "
        f"{meta['tokens']} loss tokens x {meta['bytes_per_token']} B = {mib:.2f} MiB in {store.path} ({how})")


def served(spec) -> tuple[ServedTargets, str]:
    cfg = settings(spec.recipe)
    client = ServedTeacher(cfg["teacher_model_server_url"], cfg["loss_top_k"], cfg["loss_temperature"],
                           timeout_s=cfg["teacher_timeout_s"], retries=cfg["teacher_retries"]).connect()
    return ServedTargets(client), (
        f"teacher: served by {client.url} (model {client.model}): top-{client.k} prompt log-probs at T "
        f"{client.temperature:g} per micro-batch, {client.timeout_s:g} s timeout, {client.retries} retries")
