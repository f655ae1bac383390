"""Read back what clusterops.trackers wrote, with each tracker's own reader.

- TensorBoard: ``EventAccumulator`` (tensorboard.backend.event_processing) over the log dir.
- MLflow: ``MlflowClient`` on the tracking store.
- W&B offline: the run files ``<dir>/wandb/offline-run-*-<id>/run-<id>.wandb``. wandb 0.31
  no longer ships a Python reader of them (its ``datastore`` module left with the Go core),
  so the framing (W&B's documented variant of the LevelDB log: a 7-byte header ``:W&B``,
  magic, version; 32 KiB blocks of records, each CRC-32, length, type) is read here, and
  every record is decoded with wandb's own protobuf (``wandb.proto.wandb_internal_pb2.Record``).
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Dict, List

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(logdir: Path) -> Dict[str, List[tuple]]:
    """tag -> [(step, value)] of every scalar, and '<tag>#text' -> [(step, text)] of the text summaries."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(logdir), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    out: Dict[str, List[tuple]] = {}
    for tag in ea.Tags()["scalars"]:
        out[tag] = [(e.step, e.value) for e in ea.Scalars(tag)]
    for tag in ea.Tags()["tensors"]:
        out[tag + "#text"] = [(e.step, b"".join(e.tensor_proto.string_val).decode()) for e in ea.Tensors(tag)]
    return out


def _wandb_records(path: Path) -> List[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B run file"
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:                     # the block's tail is padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if crc == 0 and length == 0 and kind == 0:
            pos += left                  # zero padding up to the next block
            continue
        body = data[pos + 7:pos + 7 + length]
        if len(body) < length:
            break                        # a record still being written
        assert zlib.crc32(bytes([kind]) + body) & 0xFFFFFFFF == crc, f"{path}: bad checksum at {pos}"
        pos += 7 + length
        if kind == FULL:
            out.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            out.append(pending + body)
            pending = b""
    return out


def wandb_runs(wandb_dir: Path, run_id: str) -> List[dict]:
    """Every offline incarnation of the run ``run_id`` under ``wandb_dir`` (the ``dir`` given to
    wandb.init), oldest first: {"run": the run record's fields, "history": [row dict, ...]}."""
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for f in sorted(Path(wandb_dir).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        run, history = {}, []
        for body in _wandb_records(f):
            rec = pb.Record()
            rec.ParseFromString(body)
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run = {"run_id": rec.run.run_id, "project": rec.run.project, "display_name": rec.run.display_name}
            elif kind == "history":
                history.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item})
        out.append({"file": f, "run": run, "history": history})
    return out
