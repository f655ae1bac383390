"""The state codec: what ``sdk.save`` was given <-> the files of a checkpoint, exactly.

A state is split into a *skeleton* and its *tensors*. The skeleton is the container
structure (dict, OrderedDict, list, tuple, torch.Size) with every key kept with its type
(``7`` stays an int, ``"7"`` a string) and every non-tensor leaf kept by value (None,
bool, int, float down to the NaN bits, str, bytes, numpy scalars, torch dtypes and
devices), written as strict JSON (``state.skeleton.json``); each tensor leaf is a
placeholder naming a flat key built from its path (``model/0.weight``,
``o/state/#0/momentum_buffer``), and the tensors are stored under those keys: one
``torch.save`` of a flat dict for one process, torch's distributed checkpoint (DCP) for
many ranks, where the flat dict of (possibly sharded) tensors is all DCP ever sees, so
nothing is flattened or dropped and a template's DTensors load in place.
Numpy arrays travel as their raw bytes (a uint8 tensor) with dtype and shape in the
skeleton. Loading runs no code: JSON, and ``torch.load(weights_only=True)`` or DCP reads of
tensors. What the codec cannot keep (a custom object, a set, a lambda, a namedtuple) is
refused by :func:`encode` with one line naming its path in the state, before anything is
written. The manifest of a checkpoint written through the codec carries
``"state_codec": CODEC_VERSION``; one without it is read the way earlier versions wrote it
(:func:`load_torch_state` and :func:`load_dcp_state` fall back to the old readers).
"""

from __future__ import annotations

import base64
import json
import math
import re
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

from clusterops.checkpoint.format import CheckpointError
from clusterops.errors import InputError

CODEC_VERSION = 1
#: The manifest field that says which codec wrote the state (absent: the earlier format).
MANIFEST_KEY = "state_codec"
#: The skeleton of a checkpoint's state, next to its tensors (``state.pt`` or ``dcp/``).
SKELETON_FILE = "state.skeleton.json"
#: Marks a skeleton file, and a state held inside a rank file (its ``rank_state``).
BLOB_FORMAT = "clusterops-state"
#: A skeleton larger than this is refused on reading (it holds no tensor data).
MAX_SKELETON_BYTES = 256 << 20


class UnsaveableState(InputError):
    """The state holds something the codec cannot keep exactly (refused before any write)."""


@dataclass
class Encoded:
    """A state split for writing: ``skeleton`` (JSON-able) and ``tensors`` by flat key."""

    skeleton: Any
    tensors: Dict[str, Any] = field(default_factory=dict)
    _bytes: Optional[bytes] = field(default=None, repr=False)

    def skeleton_bytes(self) -> bytes:
        """The skeleton file's content (made once; the skeleton is never changed after encode)."""
        if self._bytes is None:
            self._bytes = json.dumps({"format": BLOB_FORMAT, "version": CODEC_VERSION, "skeleton": self.skeleton},
                                     separators=(",", ":"), allow_nan=False).encode()
        return self._bytes


# ----------------------------------------------------------------------------- paths and keys


def show_path(path: Tuple, root: str = "state") -> str:
    """``state["o"]["param_groups"][0]``: where a value sits, as Python would index it."""
    return root + "".join(f"[{k!r:.60}]" for k in path)


def _escape(s: str) -> str:
    # "/" separates the parts of a flat key, "#" starts a non-string key and "%" escapes;
    # an empty string becomes a lone "%", which no escaped text can be.
    if s == "":
        return "%"
    out = s.replace("%", "%25").replace("/", "%2F")
    return "%23" + out[1:] if out.startswith("#") else out


def _key_part(k: Any) -> str:
    if type(k) is str:
        return _escape(k)
    # Non-string keys and list indices: "#" + their JSON (so 1, True, 1.0 and "1" differ).
    return "#" + _escape(json.dumps(_encode_scalar(k), separators=(",", ":"), allow_nan=False))


def flat_key(path: Tuple) -> str:
    """The flat key a tensor at ``path`` is stored under (an injective function of the path)."""
    return "/".join(_key_part(k) for k in path) if path else "#"


# ----------------------------------------------------------------------------- encode


_KEY_TYPES = (str, int, float, bool, type(None), bytes)
_MAX_INT_BITS = 14_000  # about 4200 decimal digits: Python's int <-> str limit is 4300


def _float_node(x: float):
    if math.isfinite(x):
        return x  # JSON keeps "1.0" a float and repr round-trips exactly (-0.0 included)
    return {"f": struct.pack(">d", x).hex()}  # NaN payload and sign, infinities: the bits


def _encode_scalar(o: Any):
    """A key or a plain leaf as a JSON node; None when its type is not one of them."""
    t = type(o)
    if o is None or t is bool or t is int or t is str:
        return o
    if t is float:
        return _float_node(o)
    if t is bytes:
        return {"b": base64.b64encode(o).decode()}
    return None


def _type_name(o: Any) -> str:
    t = type(o)
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


class _Encoder:
    def __init__(self, distributed: bool, lenient: bool = False, root: str = "state"):
        import torch

        self.torch = torch
        self.distributed = distributed
        self.lenient = lenient      # a template: collect its tensors, ignore the rest
        self.root = root
        self.tensors: Dict[str, Any] = {}
        self.active: set = set()    # ids of the containers on the current path (cycles)
        try:
            import numpy as np
        except ImportError:
            np = None
        self.np = np

    def refuse(self, path: Tuple, what: str):
        if self.lenient:
            return None
        raise UnsaveableState(f"{show_path(path, self.root)}: cannot save {what} (the checkpoint keeps tensors, numpy "
                              f"arrays, dict/list/tuple/OrderedDict and plain values only)")

    def node(self, o: Any, path: Tuple):
        torch, np = self.torch, self.np
        if isinstance(o, torch.Tensor):
            return self.tensor(o, path)
        if type(o) is int and o.bit_length() > _MAX_INT_BITS:
            return self.refuse(path, f"an int of {o.bit_length()} bits (JSON reads at most 4300 digits back)")
        if o is None or type(o) in (bool, int, str, float, bytes):
            return _encode_scalar(o)
        t = type(o)
        if t in (dict, OrderedDict, list, tuple, torch.Size):
            return self.container(o, path)
        if t is bytearray:
            return {"ba": base64.b64encode(bytes(o)).decode()}
        if t is torch.dtype:
            return {"dtype": str(o).split(".", 1)[1]}
        if t is torch.device:
            return {"device": str(o)}
        if np is not None and t is np.ndarray:
            return self.ndarray(o, path)
        if np is not None and isinstance(o, np.generic) and o.dtype.kind in "biufcmM":
            return {"npscalar": o.dtype.str, "b": base64.b64encode(o.tobytes()).decode()}
        return self.refuse(path, f"a {_type_name(o)}")

    def container(self, o, path: Tuple):
        if id(o) in self.active:
            return self.refuse(path, "a container that contains itself")
        self.active.add(id(o))
        try:
            t = type(o)
            if t is list or t is tuple:
                return {"l" if t is list else "t": [self.node(v, path + (i,)) for i, v in enumerate(o)]}
            if t is self.torch.Size:
                return {"size": [int(v) for v in o]}
            items = []
            for k, v in o.items():
                kn = _encode_scalar(k) if type(k) in _KEY_TYPES else None
                if kn is None and k is not None:
                    if self.refuse(path, f"a dict key of type {_type_name(k)} ({k!r:.40})") is None:
                        continue
                items.append([kn, self.node(v, path + (k,))])
            return {"d" if t is dict else "od": items}
        finally:
            self.active.discard(id(o))

    def tensor(self, o, path: Tuple):
        torch = self.torch
        if o.layout != torch.strided and self.distributed:
            return self.refuse(path, f"a {o.layout} tensor with many ranks (DCP stores strided tensors)")
        if o.device.type == "meta":
            return self.refuse(path, "a tensor on the meta device (it has no data)")
        key = flat_key(path)
        node = {"T": key}
        if self.lenient:
            self.tensors[key] = o   # a template's own tensor: loaded into in place
            return node
        if type(o) is torch.nn.Parameter:
            node["param"] = bool(o.requires_grad)
            o = o.detach()
        elif o.requires_grad:
            node["grad"] = True
            o = o.detach()
        self.tensors[key] = o
        return node

    def ndarray(self, a, path: Tuple):
        if self.lenient:
            return None  # rebuilt from its bytes, never loaded into a template's array
        if a.dtype.kind not in "biufcmMSU" or a.dtype.fields is not None:
            return self.refuse(path, f"a numpy array of dtype {a.dtype} (objects or records)")
        torch, np = self.torch, self.np
        raw = np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=np.uint8).copy()
        key = flat_key(path)
        self.tensors[key] = torch.from_numpy(raw)
        return {"N": key, "dtype": a.dtype.str, "shape": [int(n) for n in a.shape]}


def encode(state: Any, *, distributed: bool = False, root: str = "state") -> Encoded:
    """Split ``state`` into skeleton and tensors; :class:`UnsaveableState` names what it cannot keep.

    The tensors are the state's own (detached, not copied): an async save copies them.
    ``distributed``: refuse what DCP cannot store (non-strided tensors). ``root``: the name
    the error messages give the state.
    """
    enc = _Encoder(distributed, root=root)
    out = Encoded(enc.node(state, ()), enc.tensors)
    try:
        out.skeleton_bytes()  # now, so nothing the JSON cannot hold is found mid-save
    except (ValueError, RecursionError) as e:
        raise UnsaveableState(f"{root}: cannot save it as JSON ({type(e).__name__}: {str(e)[:120]})") from None
    return out


def template_tensors(template: Any) -> Dict[str, Any]:
    """The tensors of a resume template by the flat keys their paths give (the rest is ignored)."""
    enc = _Encoder(distributed=True, lenient=True)
    enc.node(template, ())
    return enc.tensors


# ----------------------------------------------------------------------------- decode


class _Decoder:
    def __init__(self, tensors: Dict[str, Any], given: frozenset = frozenset()):
        self.tensors = tensors
        self.given = given  # keys whose tensor is the template's own (returned untouched)

    def bad(self, what: str):
        raise CheckpointError(f"state skeleton is malformed: {what}")

    def node(self, n: Any):
        if n is None or type(n) in (bool, int, str, float):
            return n
        if type(n) is not dict or len(n) < 1:
            self.bad(f"unexpected {type(n).__name__} node")
        if "d" in n or "od" in n:
            return self.mapping(n)
        if "l" in n:
            return [self.node(v) for v in self.seq(n["l"])]
        if "t" in n:
            return tuple(self.node(v) for v in self.seq(n["t"]))
        if "T" in n:
            return self.tensor(n)
        if "N" in n:
            return self.ndarray(n)
        return self.scalar(n)

    def seq(self, v):
        if type(v) is not list:
            self.bad("a container's items are not a list")
        return v

    def mapping(self, n: dict):
        out = {} if "d" in n else OrderedDict()
        for item in self.seq(n.get("d", n.get("od"))):
            if type(item) is not list or len(item) != 2:
                self.bad("a dict item is not a [key, value] pair")
            k = self.scalar(item[0]) if type(item[0]) is dict else item[0]
            if type(k) not in _KEY_TYPES or type(k) is bytearray:
                self.bad(f"a dict key of type {type(k).__name__}")
            out[k] = self.node(item[1])
        return out

    def scalar(self, n: dict):
        import torch

        try:
            if "f" in n:
                return struct.unpack(">d", bytes.fromhex(n["f"]))[0]
            if "b" in n and "npscalar" not in n:
                return base64.b64decode(n["b"], validate=True)
            if "ba" in n:
                return bytearray(base64.b64decode(n["ba"], validate=True))
            if "size" in n:
                return torch.Size([int(v) for v in self.seq(n["size"])])
            if "dtype" in n:
                dt = getattr(torch, n["dtype"], None)
                if type(dt) is not torch.dtype:
                    self.bad(f"unknown torch dtype {n['dtype']!r:.40}")
                return dt
            if "device" in n:
                return torch.device(n["device"])
            if "npscalar" in n:
                import numpy as np

                return np.frombuffer(base64.b64decode(n["b"], validate=True), dtype=self.np_dtype(n["npscalar"]))[0]
        except (ValueError, TypeError, KeyError, RuntimeError, struct.error) as e:
            self.bad(f"{type(e).__name__}: {e}"[:200])
        self.bad(f"unknown node tags {sorted(n)[:4]}")

    @staticmethod
    def np_dtype(s):
        import numpy as np

        dt = np.dtype(str(s))  # a dtype string ('<f8', '<M8[ns]') names a type; it runs nothing
        if dt.kind not in "biufcmMSU" or dt.fields is not None:
            raise ValueError(f"numpy dtype {s!r:.40} not accepted")
        return dt

    def leaf(self, key):
        if type(key) is not str or key not in self.tensors:
            self.bad(f"tensor {str(key)[:80]!r} is not in the checkpoint")
        return self.tensors[key]

    def tensor(self, n: dict):
        import torch

        key = n["T"]
        t = self.leaf(key)
        if key in self.given:
            return t
        if "param" in n:
            return torch.nn.Parameter(t, requires_grad=bool(n["param"]))
        if n.get("grad"):
            t.requires_grad_(True)
        return t

    def ndarray(self, n: dict):
        import numpy as np

        raw = self.leaf(n["N"])
        try:
            dt = self.np_dtype(n["dtype"])
            shape = tuple(int(v) for v in self.seq(n["shape"]))
            return np.frombuffer(raw.contiguous().numpy().tobytes(), dtype=dt).reshape(shape).copy()
        except (ValueError, TypeError, KeyError) as e:
            self.bad(f"numpy array {str(n['N'])[:80]!r}: {e}"[:200])


def decode(skeleton: Any, tensors: Dict[str, Any], *, given: frozenset = frozenset(), where: str = "") -> Any:
    """Rebuild the state from its skeleton and its tensors by flat key (CheckpointError if malformed)."""
    try:
        return _Decoder(tensors, given).node(skeleton)
    except RecursionError:
        raise CheckpointError(f"{where}: state skeleton is nested too deep") from None
    except CheckpointError as e:
        raise CheckpointError(f"{where}: {e.message}" if where else e.message) from None


def parse_skeleton(raw: bytes, where: str) -> Any:
    """The skeleton from its JSON text (strict: no NaN constants; format and version checked)."""
    def no_constants(c):
        raise ValueError(f"constant {c} not allowed")

    try:
        doc = json.loads(raw, parse_constant=no_constants)
    except RecursionError:
        raise CheckpointError(f"{where}: state skeleton is nested too deep") from None
    except ValueError as e:
        raise CheckpointError(f"{where}: state skeleton is not valid JSON ({str(e)[:200]})") from None
    if type(doc) is not dict or doc.get("format") != BLOB_FORMAT or "skeleton" not in doc:
        raise CheckpointError(f"{where}: not a state skeleton")
    if doc.get("version") != CODEC_VERSION:
        raise CheckpointError(f"{where}: state codec version {doc.get('version')!r:.20} not supported")
    return doc["skeleton"]


# ----------------------------------------------------------------------------- files


def to_blob(enc: Encoded) -> dict:
    """A state inside another torch.save'd object (a rank file's ``rank_state``): str and tensors,
    weights_only-loadable."""
    return {"format": BLOB_FORMAT, "version": CODEC_VERSION, "skeleton": enc.skeleton_bytes().decode(),
            "tensors": enc.tensors}


def from_blob(obj: Any, where: str) -> Any:
    if type(obj) is not dict or obj.get("format") != BLOB_FORMAT or type(obj.get("skeleton")) is not str \
            or type(obj.get("tensors")) is not dict:
        raise CheckpointError(f"{where}: no clusterops state in it")
    return decode(parse_skeleton(obj["skeleton"].encode(), where), obj["tensors"], where=where)


def codec_version(manifest: dict) -> Optional[int]:
    """The codec a checkpoint's state was written with: None for the earlier format."""
    v = manifest.get(MANIFEST_KEY)
    if v is None:
        return None
    if type(v) is not int or v != CODEC_VERSION:
        raise CheckpointError(f"manifest {MANIFEST_KEY} {v!r:.20} not supported by this clusterops")
    return v


def write_skeleton(pending, data: bytes) -> None:
    """The skeleton of a checkpoint's state, hashed while written, into its temporary."""
    w = pending.open_file(SKELETON_FILE)
    try:
        w.write(data)
    except BaseException:
        w.abandon()
        raise
    pending.finish_file(SKELETON_FILE, w)


def read_skeleton(path: Path) -> Any:
    from clusterops.checkpoint.format import _read_regular

    where = str(Path(path) / SKELETON_FILE)
    try:
        raw = _read_regular(where, MAX_SKELETON_BYTES)
    except FileNotFoundError:
        raise CheckpointError(f"{where}: missing") from None
    except OSError as e:
        raise CheckpointError(f"{where}: unreadable ({e.strerror or e})") from None
    return parse_skeleton(raw, where)


def save_one_process(root: Path, step: int, enc: Encoded, files: Dict[str, Any], *, state_file: str,
                     meta: Optional[dict], algo: str) -> Path:
    """Commit a one-process checkpoint: the skeleton, the tensors in ``state_file`` (one
    torch.save of a flat dict: a top-level tensor keeps its own name there) and ``files``
    (other torch.save'd objects, the rank file)."""
    from clusterops.checkpoint.writer import PendingCheckpoint, wrap_save_error

    data = enc.skeleton_bytes()
    pending = None
    try:
        pending = PendingCheckpoint(root, step, algo=algo)
        pending.write_torch(state_file, enc.tensors)
        write_skeleton(pending, data)
        for relname, obj in files.items():
            pending.write_torch(relname, obj)
        return pending.commit(world_size=1, kind="torch", meta=meta, codec=CODEC_VERSION)
    except BaseException as e:
        if pending is not None:
            pending.abort()
        raise wrap_save_error(e, root, step) from e


def load_torch_state(path: Path, relname: str, manifest: dict, *, weights_only: bool = True) -> Any:
    """The state of a one-process checkpoint (its tensors in ``relname``); earlier format as saved."""
    from clusterops.checkpoint.lookup import load_torch

    if codec_version(manifest) is None:
        return load_torch(path, relname, weights_only=weights_only)  # torch.save of the state itself
    skeleton = read_skeleton(path)
    tensors = load_torch(path, relname, weights_only=weights_only)
    if type(tensors) is not dict:
        raise CheckpointError(f"{Path(path) / relname}: not a dict of tensors")
    return decode(skeleton, tensors, where=str(Path(path)))


# ----------------------------------------------------------------------------- many ranks (DCP)


# DCP reads its .metadata with plain pickle.load and the non-tensor values of a checkpoint
# with torch.load(weights_only=False): either can run code from the files. These allow only
# the classes DCP's metadata is made of (seen in torch 2.13's files) and weights_only for
# the values; ``weights_only=False`` (the caller's opt-in for trusted files) uses DCP's own.
_METADATA_GLOBALS = {
    ("pathlib", "PosixPath"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    *(("torch.distributed.checkpoint.metadata", n) for n in (
        "BytesStorageMetadata", "ChunkStorageMetadata", "Metadata", "MetadataIndex", "StorageMeta",
        "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")),
}


def _refused(where: str, what: str):
    from clusterops.checkpoint.lookup import UnsafeLoadRefused

    return UnsafeLoadRefused(f"{where}: loading it would run pickled code ({what[:160]}); refused "
                             f"(weights_only=True); opt in only for a checkpoint you trust")


def _reader(dcp_path: Path, weights_only: bool):
    import pickle

    import torch
    import torch.distributed.checkpoint as dcp

    if not weights_only:
        return dcp.FileSystemReader(str(dcp_path))

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _METADATA_GLOBALS:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return getattr(torch, name)
            raise _refused(str(Path(dcp_path) / ".metadata"), f"global {module}.{name}")

    class Reader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            # FileSystemReader.read_metadata with the unpickler above.
            from torch.distributed.checkpoint.metadata import StorageMeta

            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(dcp_path))


def _weights_only_bytes(planner_cls, where: str):
    """``planner_cls`` loading DCP's non-tensor values with weights_only=True."""
    import pickle

    import torch

    class Planner(planner_cls):
        def load_bytes(self, read_item, value) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                text = str(e)
                m = re.search(r"WeightsUnpickler error:\s*(.*?)(?:\n\n|$)", text, re.S)
                raise _refused(where, " ".join((m.group(1) if m else text).split())) from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return Planner


def _dcp_failure(where: str, e: BaseException) -> CheckpointError:
    """DCP's CheckpointException (a BaseException carrying each rank's failure) as this
    package's one-line error: a refusal stays a refusal."""
    excs = [pair[0] for pair in getattr(e, "failures", {}).values()]
    for exc in excs:
        if isinstance(exc, CheckpointError):
            return exc
    first = excs[0] if excs else e
    line = (str(first).strip().splitlines() or [""])[0][:200]
    return CheckpointError(f"{where}: cannot be loaded ({type(first).__name__}: {line})")


def _dcp_load(where: str, *args, **kwargs) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(*args, **kwargs)
    except CheckpointException as e:
        raise _dcp_failure(where, e) from None


def save_dcp(enc: Encoded, dcp_path: Path, process_group) -> None:
    """Every rank: write its share of the tensors with DCP (a collective over ``process_group``)."""
    import torch.distributed.checkpoint as dcp

    dcp.save(enc.tensors, storage_writer=dcp.FileSystemWriter(dcp_path, sync_files=True),
             process_group=process_group)


def load_dcp_state(path: Path, dcp_dir: str, manifest: dict, template: Any, process_group, *,
                   weights_only: bool = True) -> Any:
    """The state of a many-rank checkpoint.

    With a ``template``, each of its tensors whose path is one of the state's is loaded in
    place (a DTensor keeps its sharding and device, each rank reads its shards: a collective
    over ``process_group``) and is the one in the returned state; a template tensor the
    checkpoint lacks is an error. Without one, every rank reads every tensor in full on its
    own (no collective). The rest comes from the skeleton. Earlier format: the old reader.
    """
    if codec_version(manifest) is None:
        return _load_dcp_before_codec(Path(path) / dcp_dir, template, process_group, weights_only)
    import torch
    import torch.distributed.checkpoint as dcp

    skeleton = read_skeleton(path)
    reader = _reader(Path(path) / dcp_dir, weights_only)
    stored = reader.read_metadata().state_dict_metadata
    given = template_tensors(template) if template is not None else {}
    missing = sorted(k for k in given if k not in stored)
    if missing:
        raise CheckpointError(f"{path}: the template has tensor {missing[0]!r:.120} that the checkpoint lacks")
    flat: Dict[str, Any] = {}
    for key, md in stored.items():
        if key in given:
            flat[key] = given[key]
        elif hasattr(md, "size") and hasattr(md, "properties"):
            flat[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            raise CheckpointError(f"{path}: DCP entry {key!r:.120} is not a tensor")
    if given:
        _dcp_load(str(path), flat, storage_reader=reader, process_group=process_group)
    else:
        _dcp_load(str(path), flat, storage_reader=reader, no_dist=True)
    return decode(skeleton, flat, given=frozenset(given), where=str(path))


def _load_dcp_before_codec(dcp_path: Path, template: Any, process_group, weights_only: bool) -> Any:
    """A DCP checkpoint written before the codec: DCP's own nested state (lossy, as it was)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    reader = _reader(dcp_path, weights_only)
    if weights_only:
        where = str(dcp_path)
        DefaultLoadPlanner = _weights_only_bytes(DefaultLoadPlanner, where)  # noqa: N806
        _EmptyStateDictLoadPlanner = _weights_only_bytes(_EmptyStateDictLoadPlanner, where)  # noqa: N806
    if template is not None:
        _dcp_load(str(dcp_path), template, storage_reader=reader, planner=DefaultLoadPlanner(),
                  process_group=process_group)
        return template
    # torch has no public call to rebuild a state from DCP's metadata alone; dcp_to_torch_save()
    # does the same with these two private pieces.
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    try:
        _load_state_dict(state_dict=state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as e:
        raise _dcp_failure(str(dcp_path), e) from None
    return state
