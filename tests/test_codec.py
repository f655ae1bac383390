"""The state codec: whatever sdk.save accepts, sdk.resume().state gives back exactly.

Property tests over generated nested states (dict/OrderedDict/list/tuple with str, int,
float, bool, None and bytes keys, empty containers, plain values, numpy arrays, tensors
of every dtype that matters: bf16, fp8 e4m3/e5m2, bool, complex, 0-d and empty) through
the codec in memory, through one-process checkpoints (sync and async; resumed and saved
again), and through DCP files written in this one process; what the codec cannot keep
is refused before anything is written, with its path; checkpoints written before the
codec still load. The many-rank round trip is tests/integration/test_codec_ranks.py.
"""

from __future__ import annotations

import collections
import json
import math
import os
import struct
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from clusterops import checkpoint as ck
from clusterops import protocol, sdk
from clusterops.checkpoint import codec

EXAMPLES = int(os.environ.get("CODEC_PROP_EXAMPLES", "60"))
PROPS = settings(max_examples=EXAMPLES, deadline=20_000, database=None,
                 phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink],
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                        HealthCheck.data_too_large])
# Files: fewer examples, each a few fsyncs and torch.save/DCP writes.
FILE_PROPS = settings(PROPS, max_examples=max(10, EXAMPLES // 3))


@pytest.fixture(autouse=True)
def fresh_sdk(monkeypatch):
    for var in (*protocol.CONTRACT_ENV, ck.FAULT_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(var, raising=False)
    sdk._reset()
    yield
    try:
        sdk.wait()
    except Exception:
        pass
    sdk._reset()


# ----------------------------------------------------------------------------- exact equality


def bits(x: float) -> bytes:
    return struct.pack(">d", x)


def assert_same(a, b, path="state"):
    """Equal in structure, container and key types, key order, values and tensor bits."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert a.requires_grad == b.requires_grad, path
        ab = a.detach().contiguous().reshape(-1).view(torch.uint8)
        bb = b.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(ab, bb), f"{path}: tensor bits differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), path
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), path
    elif isinstance(a, dict):
        ka, kb = list(a), list(b)
        assert [(type(k), k) for k in ka] == [(type(k), k) for k in kb] or _same_keys(ka, kb), f"{path}: keys {ka} != {kb}"
        for k1, k2 in zip(ka, kb):
            assert_same(a[k1], b[k2], f"{path}[{k1!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, float):
        assert bits(a) == bits(b), f"{path}: {a!r} != {b!r}"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _same_keys(ka, kb):
    # NaN keys are equal only bitwise.
    return len(ka) == len(kb) and all(type(x) is type(y) and (bits(x) == bits(y) if type(x) is float else x == y)
                                      for x, y in zip(ka, kb))


# ----------------------------------------------------------------------------- generated states

TENSOR_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
                 torch.float8_e5m2, torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool,
                 torch.complex64]
NP_DTYPES = ["<f4", "<f8", "<i8", "|u1", "|b1", "<c16", ">i4", "<M8[ns]", "<U3", "<f2"]


@st.composite
def tensors(draw):
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    dtype = draw(st.sampled_from(TENSOR_DTYPES))
    n = int(np.prod(shape)) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))  # any bit pattern: NaNs, fp8 oddities
    if dtype is torch.bool:
        raw = bytes(b & 1 for b in raw)
    t = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    if draw(st.booleans()) and t.dim() >= 2 and t.shape[0] > 1:
        t = t.transpose(0, 1)  # a non-contiguous view
    if dtype.is_floating_point and dtype.itemsize >= 2 and draw(st.integers(0, 5)) == 0:
        t = torch.nn.Parameter(t.clone(), requires_grad=draw(st.booleans()))
    return t


@st.composite
def ndarrays(draw):
    dtype = np.dtype(draw(st.sampled_from(NP_DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = int(np.prod(shape)) * dtype.itemsize
    raw = draw(st.binary(min_size=n, max_size=n))
    if dtype.kind == "b":
        raw = bytes(b & 1 for b in raw)
    if dtype.kind == "U":
        raw = np.array(draw(st.lists(st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=3),
                                     min_size=int(np.prod(shape)), max_size=int(np.prod(shape)))),
                       dtype=dtype).tobytes()
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-0.0, float("nan"), 1e-310])
KEYS = (st.text(max_size=6) | st.sampled_from(["", "/", "%", "#", "#0", "a/b", "%2F", "7", "."])
        | st.integers(-3, 2**70) | st.booleans() | st.none() | FLOATS | st.binary(max_size=4))
LEAVES = (st.none() | st.booleans() | st.integers(-2**80, 2**80) | FLOATS | st.text(max_size=8) | st.binary(max_size=8)
          | tensors() | ndarrays() | st.sampled_from([np.float32(1.5), np.int64(-3), np.bool_(True)])
          | st.sampled_from([torch.bfloat16, torch.float8_e5m2, torch.device("cpu"), torch.Size([2, 0])]))


def containers(children):
    return (st.lists(children, max_size=4) | st.lists(children, max_size=4).map(tuple)
            | st.dictionaries(KEYS, children, max_size=4)
            | st.dictionaries(KEYS, children, max_size=4).map(OrderedDict))


STATES = st.dictionaries(KEYS, st.recursive(LEAVES, containers, max_leaves=12), max_size=5)


def optimizer_states():
    """The states the brief names: optimizers before and after their first step, a scheduler."""
    out = []
    for make in (lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                 lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3)):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2)
        opt = make(m.parameters())
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        out.append({"o": opt.state_dict(), "empty": {}, 7: "x"})
        m(torch.ones(1, 3)).sum().backward()
        opt.step()
        sched.step()
        out.append({"model": m.state_dict(), "o": opt.state_dict(), "sched": sched.state_dict(), 7: "x"})
    return out


# ----------------------------------------------------------------------------- in memory


@PROPS
@given(STATES)
def test_codec_round_trip_in_memory(state):
    enc = codec.encode(state)
    skeleton = codec.parse_skeleton(enc.skeleton_bytes(), "x")  # through its JSON text
    assert_same(codec.decode(skeleton, enc.tensors), state)


@PROPS
@given(st.lists(st.lists(KEYS, max_size=4), max_size=8, unique_by=lambda p: json.dumps(
    [codec._encode_scalar(k) for k in p], sort_keys=True)))
def test_flat_keys_are_distinct_for_distinct_paths(paths):
    # 1 and True, 0 and -0.0 are distinct paths here although Python's dicts merge them: the
    # keys only have to be distinct where the paths are.
    assert len({codec.flat_key(tuple(p)) for p in paths}) == len(paths)


def test_top_level_tensors_keep_their_names_in_the_tensor_file():
    enc = codec.encode({"w": torch.zeros(1), "model": {"0.weight": torch.zeros(1)}, 3: [torch.zeros(1)]})
    assert sorted(enc.tensors) == ["#3/#0", "model/0.weight", "w"]


# ----------------------------------------------------------------------------- one process, through files


def _save_resume(state, root: Path, step: int, *, async_: bool = False, rank_state=None):
    path = sdk.save(state, step, root=root, async_=async_, rank_state=rank_state)
    if async_:
        assert path is None
        path = sdk.wait()
    assert ck.verify(path, deep=True).ok
    r = sdk.resume(root=root)
    assert r.step == step and r.path == path
    return r


@FILE_PROPS
@given(STATES, STATES, st.booleans())
def test_one_process_save_resume_is_exact_and_resaves(state, rank_state, async_):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        r = _save_resume(state, root, 1, async_=async_, rank_state=rank_state)
        assert_same(r.state, state)
        assert_same(r.rank_state, rank_state, "rank_state")
        r2 = _save_resume(r.state, root, 2, rank_state=r.rank_state)   # resumed, saved again
        assert_same(r2.state, state)
        assert_same(r2.rank_state, rank_state, "rank_state")


@pytest.mark.parametrize("i", range(8))
def test_optimizer_and_scheduler_states_one_process(tmp_path, i):
    state = optimizer_states()[i]
    r = _save_resume(state, tmp_path, 1)
    assert_same(r.state, state)
    assert_same(_save_resume(r.state, tmp_path, 2).state, state)


# ----------------------------------------------------------------------------- DCP files, in one process


def _dcp_round_trip(state, d: Path, template=None):
    enc = codec.encode(state, distributed=True)
    codec.save_dcp(enc, d / "dcp", None)
    (d / codec.SKELETON_FILE).write_bytes(enc.skeleton_bytes())
    return codec.load_dcp_state(d, "dcp", {codec.MANIFEST_KEY: codec.CODEC_VERSION}, template, None)


@FILE_PROPS
@given(STATES)
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_files_round_trip_is_exact(state):
    with tempfile.TemporaryDirectory() as d:
        assert_same(_dcp_round_trip(state, Path(d)), state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_template_tensors_are_loaded_in_place_and_the_rest_comes_back(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "o": {"state": {}, "param_groups": [{"lr": 0.1}]},
             "extra": torch.ones(2, dtype=torch.bfloat16), 7: "x"}
    tmpl_w = torch.zeros(2, 3)
    out = _dcp_round_trip(state, tmp_path, template={"model": {"w": tmpl_w}})
    assert out["model"]["w"] is tmpl_w and torch.equal(tmpl_w, state["model"]["w"])
    assert_same(out, state)
    with pytest.raises(ck.CheckpointError, match="template has tensor 'model/nope'"):
        _dcp_round_trip(state, tmp_path / "again", template={"model": {"nope": torch.zeros(1)}})


# ----------------------------------------------------------------------------- refusals


class Custom:
    pass


Point = collections.namedtuple("Point", "x y")


@pytest.mark.parametrize("bad, where, what", [
    ({"o": {"param_groups": [{"x": {1, 2}}]}}, "state['o']['param_groups'][0]['x']", "a set"),
    ({"f": lambda: 1}, "state['f']", "a function"),
    ({"c": [Custom()]}, "state['c'][0]", "Custom"),
    ({"p": Point(1, 2)}, "state['p']", "Point"),
    ({(1, 2): 3}, "state", "a dict key of type tuple"),
    ({"a": np.array([object()], dtype=object)}, "state['a']", "numpy array of dtype object"),
    ({"m": torch.zeros(2, device="meta")}, "state['m']", "meta device"),
    ({"n": [10 ** 5000]}, "state['n'][0]", "an int of"),
])
def test_what_cannot_be_kept_is_refused_before_anything_is_written(tmp_path, bad, where, what):
    root = tmp_path / "ck"
    with pytest.raises(codec.UnsaveableState) as e:
        sdk.save(bad, 1, root=root, async_=True)   # async too: refused here, not at wait()
    msg = e.value.message
    assert msg.startswith(f"{where}: cannot save ") and what in msg and "\n" not in msg, msg
    assert e.value.exit_code == 2
    assert not root.exists() or os.listdir(root) == []
    assert sdk.wait() is None


def test_a_state_that_contains_itself_is_refused(tmp_path):
    loop: list = [1]
    loop.append(loop)
    with pytest.raises(codec.UnsaveableState, match=r"^state\['l'\]\[1\]: cannot save a container that contains itself"):
        sdk.save({"l": loop}, 1, root=tmp_path)


def test_rank_state_refusal_names_rank_state(tmp_path):
    with pytest.raises(codec.UnsaveableState, match=r"^rank_state\['s'\]: cannot save a set"):
        sdk.save({"w": torch.zeros(1)}, 1, root=tmp_path, rank_state={"s": set()})


# ----------------------------------------------------------------------------- reading stays code-free and strict


@pytest.mark.parametrize("skeleton, msg", [
    ('{"format": "clusterops-state", "version": 1, "skeleton": {"x": 1}}', "unknown node tags"),
    ('{"format": "clusterops-state", "version": 9, "skeleton": null}', "version 9 not supported"),
    ('{"format": "clusterops-state", "version": 1, "skeleton": {"f": NaN}}', "not valid JSON"),
    ('{"format": "clusterops-state", "version": 1, "skeleton": {"T": "nope"}}', "not in the checkpoint"),
    ('{"format": "clusterops-state", "version": 1, "skeleton": {"dtype": "__class__"}}', "unknown torch dtype"),
    ('{"format": "clusterops-state", "version": 1, "skeleton": {"npscalar": "|O", "b": ""}}', "not accepted"),
    ('{"format": "clusterops-state", "version": 1, "skeleton": ' + '{"l": [' * 5000 + ']}' * 5000 + '}',
     "nested too deep"),
])
def test_a_damaged_skeleton_is_a_one_line_checkpoint_error(tmp_path, skeleton, msg):
    path = sdk.save({"w": torch.zeros(1)}, 1, root=tmp_path)
    (path / codec.SKELETON_FILE).write_text(skeleton)
    with pytest.raises(ck.CheckpointError, match=msg) as e:
        codec.load_torch_state(path, sdk.STATE_FILE, ck.read_manifest(path))
    assert "\n" not in e.value.message
    assert sdk.resume(root=tmp_path, deep=False) is None  # skipped like any checkpoint that cannot load


def test_manifest_names_the_codec_and_the_skeleton(tmp_path):
    path = sdk.save({"w": torch.zeros(1)}, 1, root=tmp_path)
    m = ck.read_manifest(path)
    assert m[codec.MANIFEST_KEY] == codec.CODEC_VERSION
    assert {"state.pt", codec.SKELETON_FILE, "rank_0.pt"} <= set(m["files"])
    ck.shrink(path)  # a re-save of the files keeps the codec's mark
    assert ck.read_manifest(path)[codec.MANIFEST_KEY] == codec.CODEC_VERSION
    assert torch.equal(sdk.resume(root=tmp_path).state["w"], torch.zeros(1))


# ----------------------------------------------------------------------------- the format before the codec


def test_a_checkpoint_written_before_the_codec_still_loads(tmp_path):
    # What sdk.save wrote before: torch.save of the state itself, no state_codec in the manifest.
    state = {"w": torch.arange(3.0), "data": {"epoch": 2}}
    extra = {"rng": sdk.get_rng_state(), "rank_state": {"mine": 1}, "rank": 0, "step": 5}
    path = ck.save_torch(tmp_path, 5, {sdk.STATE_FILE: state, "rank_0.pt": extra})
    assert codec.MANIFEST_KEY not in ck.read_manifest(path)
    r = sdk.resume(root=tmp_path)
    assert r.step == 5 and r.rng_restored and r.rank_state == {"mine": 1}
    assert_same(r.state, state)


def test_unknown_codec_version_is_refused(tmp_path):
    path = sdk.save({"w": torch.zeros(1)}, 1, root=tmp_path)
    m = ck.read_manifest(path)
    m[codec.MANIFEST_KEY] = 99
    with pytest.raises(ck.CheckpointError, match="state_codec 99 not supported"):
        codec.load_torch_state(path, sdk.STATE_FILE, m)


def test_float_leaves_keep_their_bits():
    for x in (float("nan"), -float("nan"), struct.unpack(">d", bytes.fromhex("7ff0000000000001"))[0],
              float("inf"), -0.0, 5e-324, math.pi):
        enc = codec.encode({"x": x, x: 1})
        out = codec.decode(codec.parse_skeleton(enc.skeleton_bytes(), "x"), {})
        assert bits(out["x"]) == bits(x) and bits(next(k for k in out if k != "x")) == bits(x)


class _RunsCode:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    import pickle

    _dcp_round_trip({"w": torch.ones(2)}, tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    with pytest.raises(ck.UnsafeLoadRefused, match=r"\.metadata: loading it would run pickled code \(global pathlib"):
        codec.load_dcp_state(tmp_path, "dcp", {codec.MANIFEST_KEY: codec.CODEC_VERSION}, None, None)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_checkpoint_written_before_the_codec_still_loads_and_stays_code_free(tmp_path):
    # What sdk.save wrote with many ranks before: dcp.save of the nested state itself, with its
    # non-tensor values pickled inside DCP's files.
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.arange(4.0), "opt": {"lr": 0.1}}, storage_writer=dcp.FileSystemWriter(tmp_path / "old"),
             no_dist=True)
    out = codec.load_dcp_state(tmp_path, "old", {}, None, None)
    assert torch.equal(out["w"], torch.arange(4.0)) and out["opt"] == {"lr": 0.1}
    tmpl = {"w": torch.zeros(4)}
    assert codec.load_dcp_state(tmp_path, "old", {}, tmpl, None) is tmpl and torch.equal(tmpl["w"], torch.arange(4.0))
    marker = tmp_path / "ran"
    dcp.save({"w": torch.arange(4.0), "x": _RunsCode(marker)}, storage_writer=dcp.FileSystemWriter(tmp_path / "bad"),
             no_dist=True)
    marker.unlink(missing_ok=True)
    with pytest.raises(ck.UnsafeLoadRefused, match="bad: loading it would run pickled code"):
        codec.load_dcp_state(tmp_path, "bad", {}, None, None)
    assert not marker.exists()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_damaged_dcp_tensor_data_is_a_one_line_checkpoint_error(tmp_path):
    _dcp_round_trip({"w": torch.arange(1000.0)}, tmp_path)
    data = next(p for p in (tmp_path / "dcp").iterdir() if p.suffix == ".distcp")
    os.truncate(data, 100)
    with pytest.raises(ck.CheckpointError) as e:   # not DCP's CheckpointException (a BaseException)
        codec.load_dcp_state(tmp_path, "dcp", {codec.MANIFEST_KEY: codec.CODEC_VERSION}, None, None)
    assert "cannot be loaded" in e.value.message and "\n" not in e.value.message
