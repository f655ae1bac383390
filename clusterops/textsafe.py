"""Text from storage made safe to print on a terminal or to put in HTML/SVG.

Stored text (a history row's ``detail``, a timeline's fields, names found on disk) may
hold anything a probe, an admin or an attacker wrote: terminal control sequences that
clear the screen or retitle the window, carriage returns that overwrite a line, bidi
overrides that reorder it, lone surrogates that make printing itself fail, markup.
Every place that prints such text goes through one of these helpers:

- :func:`terminal` for a terminal: C0 controls (except newline and tab where the field
  is multi-line), DEL, C1 controls (U+0080-U+009F, which include the 8-bit CSI),
  ESC, the Unicode line/paragraph separators, bidi embedding/override/isolate
  controls and lone surrogates are written visibly as ``\\xNN`` / ``\\uNNNN``;
- :func:`html_text` for HTML and SVG: the same visible escapes (a control character
  makes an SVG file invalid XML; newline and tab are kept, they are plain white space
  there), then ``html.escape`` (quotes too, so it is safe in attributes);
- :func:`shorten` cuts raw text; the escaping helpers take ``limit`` and shorten
  *before* escaping, so a cut never splits an entity or an escape.

Standard library only.
"""

from __future__ import annotations

import html
import re
from typing import Optional

ELLIPSIS = "…"

# Always escaped: C0 but tab and newline, CR, DEL, C1, line/paragraph separators, bidi
# embeddings/overrides/isolates, the BOM/ZWNBSP, lone surrogates.
_ALWAYS = "\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ufeff\ud800-\udfff"
_MULTI = re.compile(f"[{_ALWAYS}]")
_SINGLE = re.compile(f"[\t\n{_ALWAYS}]")


def _visible(m: "re.Match") -> str:
    c = ord(m.group(0))
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def shorten(text: str, limit: Optional[int]) -> str:
    """text cut to at most ``limit`` characters (an ellipsis marks a cut). Raw text only:
    never shorten text already escaped."""
    if limit is None or len(text) <= limit:
        return text
    if limit <= 1:
        return text[:max(limit, 0)]
    return text[:limit - 1] + ELLIPSIS


def terminal(value: object, *, multiline: bool = False, limit: Optional[int] = None) -> str:
    """``value`` as text safe to print on a terminal: control characters written
    visibly (``\\x1b``); with ``multiline`` newlines and tabs are kept. ``limit``
    shortens the raw text first."""
    text = shorten(value if isinstance(value, str) else str(value), limit)
    return (_MULTI if multiline else _SINGLE).sub(_visible, text)


def html_text(value: object, limit: Optional[int] = None) -> str:
    """``value`` as HTML/SVG text or attribute value: shortened raw (``limit``), control
    characters written visibly, then ``&<>"'`` escaped."""
    text = shorten(value if isinstance(value, str) else str(value), limit)
    return html.escape(_MULTI.sub(_visible, text), quote=True)
