"""Slurm's generic resources (``Gres=``) of a node: how many GPUs Slurm says it has.

Shapes seen in ``scontrol show node`` / ``sinfo --json`` (22.05 .. 24.11):
``gpu:4``, ``gpu:h100:8``, ``gpu:h100:8(S:0-1)``, ``gpu:a100:4,gpu:v100:2``,
``gpu:8(S:0-1),nic:1``, ``gpu:h100:4(IDX:0-3)``, and ``(null)`` or empty for none.
"""

from __future__ import annotations

import re
from typing import Optional

_ITEM = re.compile(r"^(?P<name>[^:()]+)(?::(?P<rest>[^()]*))?(?:\(.*\))?$")


def gpu_count(gres: Optional[str]) -> Optional[int]:
    """Total GPUs in a Gres string; None when it names no GPUs (or says nothing)."""
    if not gres or gres.strip() in ("(null)", "N/A"):
        return None
    total = 0
    seen = False
    depth = 0
    item = ""
    items = []
    for ch in gres.strip():  # split on commas outside parentheses: "(S:0-1)" may hold commas
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(0, depth - 1)
        if ch == "," and depth == 0:
            items.append(item)
            item = ""
        else:
            item += ch
    items.append(item)
    for raw in items:
        m = _ITEM.match(raw.strip())
        if not m or m.group("name") != "gpu":
            continue
        parts = (m.group("rest") or "").split(":")
        n = parts[-1] if parts and parts[-1] else "1"
        if not n.isdigit():  # "gpu:h100" with no count means one
            n = "1" if len(parts) == 1 else ""
        if not n.isdigit():
            continue
        total += int(n)
        seen = True
    return total if seen else None
