"""A hang with a name: which rank never entered the collective the others wait in (pure).

When the ranks stop beating, one stuck rank soon blocks every other rank in its next
collective, so the heartbeats alone rarely name it (every rank falls silent within a
second). Before the supervisor kills a hung step it asks every rank for torch's flight
recorder (``TORCH_FR_BUFFER_SIZE``; NCCL, and gloo in torch >= 2.8): per process group, the
sequence number of the last collective the rank enqueued and of the last one that
completed. :func:`name_hang` reads those:

- on a process group where some ranks wait (enqueued > completed), the collective they
  wait in is the highest sequence number enqueued there;
- a rank of that group whose last enqueued collective is lower never entered it: it is
  stuck elsewhere (a data loader, a slow or broken device, a Python loop), and it is named;
- when every rank of the group entered it, or no rank waits, the recorder names nobody
  (the collective itself hangs: a link, a lost peer);
- a rank that sent no dump is listed as silent, never named from the recorder alone (it
  may be dead, or stuck holding the interpreter lock).

The dumps come through the heartbeat channel (a dump request in the supervisor's beacons,
answered by each rank's watch thread: ``sdk._dump_flight_recorder``) into the heartbeat
directory (``protocol.write_flightrec``). NCCL's RAS report (NCCL >= 2.24) is read beside it:
:mod:`clusterops.supervisor.ncclras`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple


@dataclass(frozen=True)
class Naming:
    """What the dumps say: the ranks named (never entered the collective the others wait in),
    a one-line why, the ranks that sent no dump, and those whose dump had no recorder."""

    ranks: Tuple[int, ...] = ()
    why: str = ""
    silent: Tuple[int, ...] = ()
    unusable: Tuple[int, ...] = ()
    waiting: Dict[str, Tuple[int, ...]] = field(default_factory=dict)   # pg -> ranks waiting there


def _int(v) -> Optional[int]:
    try:
        return int(v)
    except (TypeError, ValueError):
        return None


def _last_name(doc: Mapping, pg: str, seq: int) -> str:
    for e in reversed(doc.get("entries") or []):
        if str((e.get("process_group") or [""])[0]) == pg and _int(e.get("collective_seq_id")) == seq:
            return str(e.get("profiling_name") or "")
    return ""


def name_hang(dumps: Mapping[int, Mapping], ranks: Sequence[int]) -> Naming:
    """rank -> its dump (``sdk._dump_flight_recorder``'s JSON) for the ``ranks`` of the step."""
    silent = tuple(sorted(r for r in ranks if r not in dumps))
    unusable = tuple(sorted(r for r, d in dumps.items() if d.get("error") or not d.get("pg_status")))
    status: Dict[str, Dict[int, Tuple[int, int]]] = {}
    for r, d in dumps.items():
        for pg, st in (d.get("pg_status") or {}).items():
            enq, comp = _int((st or {}).get("last_enqueued_collective")), _int((st or {}).get("last_completed_collective"))
            if enq is not None and comp is not None:
                status.setdefault(str(pg), {})[r] = (enq, comp)
    named: List[int] = []
    whys: List[str] = []
    waiting_by_pg: Dict[str, Tuple[int, ...]] = {}
    for pg, per in sorted(status.items()):
        waiting = sorted(r for r, (enq, comp) in per.items() if enq > comp)
        if not waiting:
            continue
        waiting_by_pg[pg] = tuple(waiting)
        k = max(per[r][0] for r in waiting)
        behind = sorted(r for r, (enq, _) in per.items() if enq < k)
        if not behind or len(behind) == len(per):
            continue
        op = _last_name(dumps[waiting[0]], pg, k)
        whys.append(f"process group {pg}: rank(s) {','.join(map(str, behind))} never entered collective {k}"
                    + (f" ({op})" if op else "") + f" that rank(s) {_short(waiting)} wait in")
        named += [r for r in behind if r not in named]
    if not whys:
        why = "the flight recorder names no rank: " + (
            "every rank entered the collective that hangs" if waiting_by_pg else "no rank waits in a collective")
        if not status:
            why = "no flight-recorder dump to read"
    else:
        why = "; ".join(whys)
    if silent:
        why += f"; no dump from rank(s) {_short(silent)}"
    return Naming(tuple(sorted(named)), why, silent, unusable, waiting_by_pg)


def _short(ranks: Sequence[int], most: int = 8) -> str:
    ranks = list(ranks)
    text = ",".join(map(str, ranks[:most]))
    return text + (f",... ({len(ranks)} ranks)" if len(ranks) > most else "")
