"""Read back what the trackers wrote, with the libraries' own pieces: MLflow's client on the file store, and W&B's
offline run file (.wandb) through wandb's own protobuf Record. wandb 0.31 has no Python reader of that file (its
Go core reads it), so records() walks the file's framing here: the ":W&B" header (4 bytes, magic 0xBEE1, version
0), then LevelDB-log blocks of 32 KiB, each record a 7-byte header (crc32c, length, type FULL/FIRST/MIDDLE/LAST)
and its bytes; a record spans blocks through FIRST/MIDDLE/LAST."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

HEADER = b":W&B"
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    """wandb_internal_pb2.Record objects of one .wandb file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(path).read_bytes()
    assert data[:4] == HEADER and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), f"not a .wandb file: {path}"
    pos, parts = 7, []
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        parts = [chunk] if kind in (FULL, FIRST) else parts + [chunk]
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def _key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def wandb_run(run_dir: Path) -> dict:
    """{"history": {step: {name: value}}, "config": {...}, "summary": {...}, "exit_code": int | None, "path": ...}
    of the one offline run under RUN/monitor/wandb."""
    found = sorted((Path(run_dir) / "monitor" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(found) == 1, f"expected one offline W&B run, found {found}"
    out: dict = {"history": {}, "config": {}, "summary": {}, "exit_code": None, "path": found[0]}
    for record in records(found[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {_key(i): json.loads(i.value_json) for i in record.history.item}
            out["history"].setdefault(row.get("_step"), {}).update(row)
        elif kind in ("config", "run"):
            items = record.config.update if kind == "config" else record.run.config.update
            out["config"].update({_key(i): json.loads(i.value_json) for i in items})
        elif kind == "summary":
            out["summary"].update({_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            out["exit_code"] = record.exit.exit_code
    return out


def mlflow_client(run_dir: Path):
    """(client, the one run) of the file store RUN/monitor/mlruns."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(Path(run_dir).absolute() / "monitor" / "mlruns").as_uri())
    runs = [run for exp in client.search_experiments() for run in client.search_runs([exp.experiment_id])]
    assert len(runs) == 1, f"expected one MLflow run, found {len(runs)}"
    return client, runs[0]
