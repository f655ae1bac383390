"""Strict JSON for every machine-readable output.

Python's ``json`` writes ``NaN``, ``Infinity`` and ``-Infinity`` for non-finite floats;
those are not JSON (RFC 8259) and strict parsers (``jq``, Go, JavaScript's
``JSON.parse``) refuse the whole document. A probe value can be NaN (a GPU sensor
that reads nothing) or infinite (a division by a zero duration), so every ``--json``
output goes through :func:`dumps`: non-finite floats become ``null``, values JSON
cannot carry (paths, bytes, sets, dataclass-like objects) become strings, and the
result is checked with ``allow_nan=False``, so a stray NaN can never slip through.
"""

from __future__ import annotations

import json
import math
import numbers
from typing import Any, Optional

# Containers nested deeper than this are cut (a cycle or a pathological document must
# not crash the output with a RecursionError).
MAX_DEPTH = 200


def finite(v: Any) -> Optional[float]:
    """``v`` as a finite float, or None (bools, strings, NaN, infinities, ints too big)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def clean(value: Any, _depth: int = 0) -> Any:
    """A copy of ``value`` that strict JSON can carry: NaN/Infinity -> None, dict keys ->
    str, tuples/sets -> lists, anything else unknown -> ``str(value)``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if _depth >= MAX_DEPTH:
        return "..."
    if isinstance(value, dict):
        return {_key(k): clean(v, _depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [clean(v, _depth + 1) for v in items]
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    to_dict = getattr(value, "to_dict", None)
    if callable(to_dict):
        return clean(to_dict(), _depth + 1)
    if isinstance(value, numbers.Integral):      # numpy integers
        return int(value)
    if isinstance(value, numbers.Real):          # numpy floats, Fraction
        f = float(value)
        return f if math.isfinite(f) else None
    return str(value)


def _key(k: Any) -> str:
    return k if isinstance(k, str) else str(k)


def dumps(data: Any, *, indent: int | None = 2, sort_keys: bool = True) -> str:
    """Strict JSON text of ``data`` (see the module docstring)."""
    return json.dumps(clean(data), indent=indent, sort_keys=sort_keys, allow_nan=False)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"not strict JSON: {name}")


def loads_strict(text: str) -> Any:
    """Parse JSON refusing NaN/Infinity (what a strict consumer does)."""
    return json.loads(text, parse_constant=_refuse_constant)
