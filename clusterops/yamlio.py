"""The one YAML loader for every input: job specs, health profiles, site config.

It keeps each node's line for one-line errors (``file:line: key: message``) and refuses
what an input file never needs but an attacker or a typo can abuse:

- anchors, aliases (``&a`` / ``*a``) and merge keys (``<<``): an alias graph expands
  exponentially ("billion laughs") and can recurse; specs are short, spell values out;
- nesting deeper than ``MAX_DEPTH`` and more than ``MAX_NODES`` nodes;
- files larger than ``MAX_BYTES``;
- duplicate keys (YAML says they are an error; PyYAML silently keeps the last one);
- keys that are not plain scalars.

Everything raises :class:`clusterops.errors.InputError` (exit 2). PyYAML is imported
lazily (``clusterops --help`` stays light); the C parser is used when present.
"""

from __future__ import annotations

import functools
import math
import re
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from clusterops.errors import InputError

MAX_BYTES = 256 << 10
MAX_DEPTH = 64
MAX_NODES = 20_000

Lines = Dict[Tuple[Any, ...], int]
_PLAIN_TAGS = (None, "!", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:map")


def _yaml():
    import yaml  # lazy: keeps the CLI start light

    return yaml


@functools.lru_cache(maxsize=1)
def _loader_class():
    yaml = _yaml()
    try:
        from yaml.cyaml import CParser as parser  # libyaml: fast, and bounds flow nesting itself
    except ImportError:  # pragma: no cover - PyYAML built without libyaml
        parser = None
    if parser is not None:
        class Loader(parser, yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
            def __init__(self, stream):
                parser.__init__(self, stream)
                yaml.constructor.SafeConstructor.__init__(self)
                yaml.resolver.Resolver.__init__(self)
    else:  # pragma: no cover - PyYAML without libyaml
        class Loader(yaml.reader.Reader, yaml.scanner.Scanner, yaml.parser.Parser,
                     yaml.constructor.SafeConstructor, yaml.resolver.Resolver):
            def __init__(self, stream):
                yaml.reader.Reader.__init__(self, stream)
                yaml.scanner.Scanner.__init__(self)
                yaml.parser.Parser.__init__(self)
                yaml.constructor.SafeConstructor.__init__(self)
                yaml.resolver.Resolver.__init__(self)
    return Loader


_PLAIN_KEY = re.compile(r"[\w.\-/$@+:<>]+")


def key_text(k: Any) -> str:
    """A key as it may appear in a one-line message: plain names as they are, others quoted."""
    return k if isinstance(k, str) and _PLAIN_KEY.fullmatch(k) else repr(k)


def dotted(path: Tuple[Any, ...]) -> str:
    """A key path as messages write it: ``a.b[2].c`` (list indexes in brackets)."""
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) and not isinstance(p, bool) else (("." if out else "") + key_text(p))
    return out



def _one_line(x: Any) -> str:
    return " ".join(str(x).split())


def _at(source: str, mark) -> str:
    return f"{source}:{mark.line + 1}" if mark is not None else source


class _Composer:
    """Events -> node tree, refusing anchors/aliases, bounding depth and node count."""

    def __init__(self, loader, source: str, max_depth: int, max_nodes: int):
        self.loader = loader
        self.source = source
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.nodes = 0

    def node(self, depth: int):
        yaml = _yaml()
        ev = self.loader.get_event()
        if isinstance(ev, yaml.AliasEvent):
            raise InputError(f"{_at(self.source, ev.start_mark)}: YAML aliases (*{ev.anchor}) are not "
                             "supported: write the value out")
        if getattr(ev, "anchor", None) is not None:
            raise InputError(f"{_at(self.source, ev.start_mark)}: YAML anchors (&{ev.anchor}) are not "
                             "supported: write the value out")
        if depth > self.max_depth:
            raise InputError(f"{_at(self.source, ev.start_mark)}: nested deeper than {self.max_depth} levels")
        self.nodes += 1
        if self.nodes > self.max_nodes:
            raise InputError(f"{_at(self.source, ev.start_mark)}: more than {self.max_nodes} YAML nodes")
        if isinstance(ev, yaml.ScalarEvent):
            tag = ev.tag
            if tag is None or tag == "!":
                tag = self.loader.resolve(yaml.ScalarNode, ev.value, ev.implicit)
                if tag == "tag:yaml.org,2002:value":  # a bare "=": PyYAML resolves it but cannot build it
                    tag = "tag:yaml.org,2002:str"
            return yaml.ScalarNode(tag, ev.value, ev.start_mark, ev.end_mark, style=ev.style)
        if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)) and ev.tag not in _PLAIN_TAGS:
            raise InputError(f"{_at(self.source, ev.start_mark)}: YAML tag {ev.tag} is not supported")
        if isinstance(ev, yaml.SequenceStartEvent):
            tag = ev.tag
            if tag is None or tag == "!":
                tag = self.loader.resolve(yaml.SequenceNode, None, ev.implicit)
            node = yaml.SequenceNode(tag, [], ev.start_mark, None, flow_style=ev.flow_style)
            while not self.loader.check_event(yaml.SequenceEndEvent):
                node.value.append(self.node(depth + 1))
            node.end_mark = self.loader.get_event().end_mark
            return node
        if isinstance(ev, yaml.MappingStartEvent):
            tag = ev.tag
            if tag is None or tag == "!":
                tag = self.loader.resolve(yaml.MappingNode, None, ev.implicit)
            node = yaml.MappingNode(tag, [], ev.start_mark, None, flow_style=ev.flow_style)
            while not self.loader.check_event(yaml.MappingEndEvent):
                k = self.node(depth + 1)
                v = self.node(depth + 1)
                node.value.append((k, v))
            node.end_mark = self.loader.get_event().end_mark
            return node
        raise InputError(f"{_at(self.source, ev.start_mark)}: unexpected YAML event {type(ev).__name__}")

    def single(self):
        yaml = _yaml()
        self.loader.get_event()  # StreamStart
        node = None
        if not self.loader.check_event(yaml.StreamEndEvent):
            self.loader.get_event()  # DocumentStart
            node = self.node(1)
            self.loader.get_event()  # DocumentEnd
        if not self.loader.check_event(yaml.StreamEndEvent):
            ev = self.loader.get_event()
            raise InputError(f"{_at(self.source, ev.start_mark)}: more than one YAML document in the file")
        return node


def compose(text: str, source: str, *, max_depth: int = MAX_DEPTH, max_nodes: int = MAX_NODES,
            max_bytes: int = MAX_BYTES):
    """YAML text -> a PyYAML node tree (None for an empty document) with no aliases in it."""
    yaml = _yaml()
    if len(text) > max_bytes:
        raise InputError(f"{source}: larger than {max_bytes // 1024} KiB; not a hand-written input file")
    loader = None
    try:
        loader = _loader_class()(text)
        return _Composer(loader, source, max_depth, max_nodes).single()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise InputError(f"{_at(source, mark)}: YAML error: {_one_line(e.problem or e.context)}") from None
    except yaml.YAMLError as e:
        raise InputError(f"{source}: YAML error: {_one_line(e) or type(e).__name__}") from None
    except RecursionError:  # the parser's own recursion, before our depth bound
        raise InputError(f"{source}: nested too deeply") from None
    finally:
        if loader is not None:
            loader.dispose()


def to_python(node, source: str, lines: Optional[Lines] = None, path: Tuple[Any, ...] = (),
              scalar: Optional[Callable[[Any, Tuple[Any, ...], Callable[[], Any]], Any]] = None) -> Any:
    """Node tree -> plain dict/list/scalars, recording each key's and item's line in ``lines``.

    ``scalar(node, path, construct)``, when given, makes each scalar's value; ``construct()``
    is the default (SafeLoader's rules). The job spec uses it to take text keys as written."""
    yaml = _yaml()
    loader = _loader_class()("")
    lines = {} if lines is None else lines

    def walk(n, p):
        if isinstance(n, yaml.MappingNode):
            out: Dict[str, Any] = {}
            for k, v in n.value:
                where = _at(source, k.start_mark)
                if not isinstance(k, yaml.ScalarNode):
                    raise InputError(f"{where}: {dotted(p) or 'top level'}: keys must be plain names")
                key = k.value
                if key == "<<" and k.tag == "tag:yaml.org,2002:merge":
                    raise InputError(f"{where}: YAML merge keys (<<) are not supported: write the keys out")
                if key in out:
                    raise InputError(f"{where}: {dotted(p + (key,))}: duplicate key "
                                     f"(first at line {lines.get(p + (key,))})")
                lines[p + (key,)] = k.start_mark.line + 1
                out[key] = walk(v, p + (key,))
            return out
        if isinstance(n, yaml.SequenceNode):
            items = []
            for i, item in enumerate(n.value):
                lines[p + (i,)] = item.start_mark.line + 1
                items.append(walk(item, p + (i,)))
            return items
        if scalar is not None:
            return scalar(n, p, lambda: construct(n, p))
        return construct(n, p)

    def construct(n, p):
        try:
            return loader.construct_object(n, deep=True)
        except yaml.YAMLError as e:
            raise InputError(f"{_at(source, n.start_mark)}: {dotted(p)}: "
                             f"{_one_line(getattr(e, 'problem', None) or e)}") from None
        except (ValueError, OverflowError, TypeError, AttributeError) as e:
            # PyYAML's constructors trip on e.g. a timestamp 2024-13-45 or `!!timestamp x`
            raise InputError(f"{_at(source, n.start_mark)}: {dotted(p)}: bad value {n.value[:40]!r}: "
                             f"{_one_line(e)}") from None

    return walk(node, path)


def load_text(text: str, source: str) -> Tuple[Any, Lines]:
    """YAML text -> (plain value, {key path: line})."""
    node = compose(text, source)
    lines: Lines = {}
    if node is None:
        return None, lines
    return to_python(node, source, lines), lines


def read_text(path: Path, what: str = "file") -> str:
    import os
    import stat

    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; only regular files are read.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except IsADirectoryError:
        raise InputError(f"{path}: is a directory, not a {what}") from None
    except FileNotFoundError:
        raise InputError(f"{path}: no such {what}") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            kind = "is a directory" if stat.S_ISDIR(os.fstat(fd).st_mode) else "not a regular file"
            raise InputError(f"{path}: {kind}, not a {what}")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            raw = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    if len(raw) > MAX_BYTES:
        raise InputError(f"{path}: larger than {MAX_BYTES // 1024} KiB; not a hand-written {what}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text (byte {e.start})") from None


def load_file(path: Path, what: str = "file") -> Tuple[Any, Lines]:
    """Read and load a YAML file; every problem is an InputError naming the file (and line)."""
    return load_text(read_text(path, what), str(path))


def is_finite_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
