"""Replicas that disagree: a cheap digest of the parameters every rank holds a copy of.

Under DDP (and in the replicated dimension of HSDP) every rank of a replica group holds the
same parameters, bit for bit, after every optimizer step: the gradients are all-reduced,
and every rank applies the same update. A rank whose copy differs computed something else
-- silent data corruption in its GPU, its memory or its link -- and the run is training on
a state no checkpoint may keep. :func:`digest` folds a rank's tensors into two int64 numbers
(the tensors' bits viewed as integers and summed with wrap-around, plain and weighted by
the tensor's place: integer sums do not depend on the order of the reduction, so the
digest is as exact as the bits, and one flipped bit anywhere changes it); the ranks
all-gather them (16 bytes a rank) and :func:`judge` names the ranks whose digest is not
the strict majority's. With no strict majority (two replicas, or a three-way split) the
evidence is ambiguous: nobody is named.

``sdk.check_replicas`` runs it every ``protocol.ENV_REPLICA_CHECK_EVERY`` steps and reports to
the supervisor (``protocol.write_replicas``), which rolls back to the newest checkpoint at
or before the last check that agreed and keeps the suspect's node out
(docs/supervisor.md, "Replicas that disagree").

Test hook (documented as one, never for production):
``CLUSTEROPS_REPLICA_FLIP=STEP:RANK[:BIT[:TENSOR]]`` flips bit ``BIT`` (default 20, in the
mantissa) of the first element of floating-point tensor ``TENSOR`` (default 0, the first;
negative counts from the end: -1 is the last) of rank ``RANK`` when ``sdk.check_replicas`` is
called at step ``STEP`` -- whether or not that step checks its replicas --, once per job (a
marker file in the job directory, so the rollback's or the anomaly replay's rerun of that step
runs clean). An exponent bit (30 for float32) of the output layer's bias sends that rank's
next loss to inf: a non-finite value that a replay on other nodes does not reproduce.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

FLIP_ENV = "CLUSTEROPS_REPLICA_FLIP"
FLIP_MARKER = "replica-flip-done"
DEFAULT_EVERY = 100
#: One int64 per position weight: tensors beyond this many reuse weights (still exact for flips).
_WEIGHT_MOD = 1_000_003


@dataclass(frozen=True)
class Verdict:
    """What one check found: ``agree`` (every rank the same), ``suspects`` (the ranks outside
    the strict majority), ``ambiguous`` (they differ but no strict majority says which)."""

    step: int
    agree: bool
    suspects: Tuple[int, ...] = ()
    ambiguous: bool = False
    groups: Dict[str, List[int]] = field(default_factory=dict)   # digest (hex) -> ranks

    def report(self, ranks: int) -> dict:
        return {"step": self.step, "agree": self.agree, "suspects": list(self.suspects),
                "ambiguous": self.ambiguous, "ranks": ranks, "digests": dict(self.groups)}


def judge(step: int, digests: Sequence[Tuple[int, int]]) -> Verdict:
    """rank -> digest (position = rank in the group) -> :class:`Verdict` (pure)."""
    keys = [f"{a & (2**64 - 1):016x}{b & (2**64 - 1):016x}" for a, b in digests]
    groups: Dict[str, List[int]] = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    if len(groups) <= 1:
        return Verdict(step, True, groups=groups)
    (top, n), = Counter(keys).most_common(1)
    if 2 * n <= len(keys):
        return Verdict(step, False, (), True, groups)
    return Verdict(step, False, tuple(r for r, k in enumerate(keys) if k != top), False, groups)


def _bits(torch, t):
    """``t``'s bits as a flat integer tensor of the same element size (a view: no copy for a
    contiguous tensor)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.reshape(-1).view(ints)


def digest(tensors: Iterable, device=None):
    """Two int64 numbers (a tensor on ``device``, default the first tensor's) for ``tensors``:
    the sum of every tensor's integer bits, and the same sums weighted by the tensor's place.
    Sums wrap around modulo 2**64 on every rank alike, so they are exact and order-free."""
    import torch

    plain = weighted = None
    for i, t in enumerate(tensors):
        if t is None:
            continue
        s = _bits(torch, t).sum(dtype=torch.int64)
        if plain is None:
            dev = device if device is not None else s.device
            plain = torch.zeros((), dtype=torch.int64, device=dev)
            weighted = torch.zeros((), dtype=torch.int64, device=dev)
        s = s.to(plain.device)
        plain += s
        weighted += s * (2 * (i % _WEIGHT_MOD) + 1)
    if plain is None:
        return torch.zeros(2, dtype=torch.int64, device=device)
    return torch.stack([plain, weighted])


def parse_flip(spec: Optional[str]) -> Optional[Tuple[int, int, int, int]]:
    """``STEP:RANK[:BIT[:TENSOR]]`` -> (step, rank, bit, tensor); None when unset. A malformed
    value raises ValueError (a typo in a test hook must not pass silently)."""
    if not spec:
        return None
    parts = spec.split(":")
    ok = len(parts) in (2, 3, 4) and all(p.isdigit() for p in parts[:3]) and (
        len(parts) < 4 or parts[3].lstrip("-").isdigit())
    if not ok:
        raise ValueError(f"{FLIP_ENV}={spec!r}: expected STEP:RANK[:BIT[:TENSOR]]")
    step, rank = int(parts[0]), int(parts[1])
    bit = int(parts[2]) if len(parts) >= 3 else 20
    index = int(parts[3]) if len(parts) == 4 else 0
    return step, rank, bit, index


def flip_one_bit(tensors: Iterable, bit: int, index: int = 0) -> bool:
    """Flip bit ``bit`` of the first element of floating-point tensor number ``index`` (negative:
    from the end) among ``tensors``, in place. False when there is no such tensor."""
    import torch

    floats = [t for t in tensors if t is not None and t.is_floating_point() and t.numel() > 0]
    if not -len(floats) <= index < len(floats):
        return False
    for t in floats[index:][:1]:
        with torch.no_grad():
            flat = t.data.view(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
            width = 8 * t.element_size()
            mask = 1 << (bit % width)
            if mask >= 1 << (width - 1):
                mask -= 1 << width
            flat[0] ^= mask
        return True
    return False


def claim_flip(hb_dir: Optional[str]) -> bool:
    """Once per job: the first caller creates the marker in the job directory (the heartbeat
    directory's grandparent, ``<job>/attempt-N/heartbeat``); later callers get False. With no
    job directory (a local run) it is once per process, which the caller keeps."""
    if not hb_dir:
        return True
    marker = Path(hb_dir).parent.parent / FLIP_MARKER
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except OSError:
        return False
    os.close(fd)
    return True
