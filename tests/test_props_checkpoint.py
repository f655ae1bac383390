"""Property tests: generated and mutated checkpoints thrown at the library and the CLI.

Every example starts from a root with two real committed checkpoints (step 1 and
step 2, torch files that resume() can load), then damages the newest one and the
root with 1-3 generated mutations: random bytes, truncations, deep JSON nesting,
NUL bytes, absolute/``..``/odd names in the manifest's file list, FIFOs, symlinks
(to /dev/zero, out of the checkpoint, in a loop), a file where a directory should be,
stray hidden entries. Whatever was generated:

- list/verify/latest/prune/resume end with a result or a one-line CheckpointError,
  never another exception, never a hang (hypothesis deadline per example and a
  pytest timeout per test);
- the latest good checkpoint (hashes checked) is step 2 when it still verifies,
  else step 1 — the untouched one — and prune never removes it;
- ``clusterops ckpt ...`` run through click's CliRunner exits 0, 1 or 2, prints no
  traceback, gives a one-line ``Error:`` on 2, and strict JSON with --json.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from clusterops import checkpoint as ck
from clusterops import sdk
from clusterops.cli import main as cli_main

# No shrink phase: replaying a hanging example while shrinking takes minutes; the
# generated failing example is reported as it is. An example takes ~30 ms here (a few
# fsyncs); the deadline leaves room for a loaded machine. CKPT_PROP_EXAMPLES=1000
# runs a longer search.
PROPS = settings(max_examples=int(os.environ.get("CKPT_PROP_EXAMPLES", "100")), deadline=10_000, database=None,
                 phases=[Phase.explicit, Phase.reuse, Phase.generate],
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
# Each example must end within this (a hang, e.g. a FIFO opened for reading, fails it
# with Hang instead of blocking the run).
# pytest-timeout alone is not enough: hypothesis would catch its one-shot failure and
# then replay the hanging example while shrinking.
EXAMPLE_LIMIT_S = 30.0


class Hang(Exception):
    pass


@contextlib.contextmanager
def bounded(seconds: float = EXAMPLE_LIMIT_S):
    def fire(signum, frame):
        raise Hang(f"example still running after {seconds} s (a hang)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _torch_bytes(obj) -> bytes:
    b = io.BytesIO()
    torch.save(obj, b)
    return b.getvalue()


BIG = torch.arange(4096, dtype=torch.float32)
STATE_BYTES = {s: _torch_bytes({"w": BIG[:16] + s, "step": s}) for s in (1, 2)}
RANK_BYTES = _torch_bytes({"rng": sdk.get_rng_state(), "rank_state": None})


def _commit(root: Path, step: int) -> Path:
    p = ck.PendingCheckpoint(root, step)
    for name, data in (("state.pt", STATE_BYTES[step]), ("rank_0.pt", RANK_BYTES), ("dcp/x.bin", b"x" * 64)):
        w = p.open_file(name)
        w.write(data)
        p.finish_file(name, w)
    return p.commit(meta={"note": "prop"})


# ----------------------------------------------------------------------------- strategies

ODD_NAMES = st.sampled_from([
    "", ".", "..", "/", "/etc/passwd", "../step_00000001/state.pt", "a//b", "./state.pt", "state.pt/",
    "dcp/../state.pt", "sta\x00te.pt", "manifest.json", "state.pt/inner", "link/state.pt", "x" * 300,
    "\ud800", "dcp", "dcp/x.bin", "rank_0.pt", " state.pt", "new\nline", "\\..\\x",
])
NAMES = st.one_of(ODD_NAMES, st.text(max_size=30))
JSON_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
                         st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=20))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda c: st.lists(c, max_size=4) | st.dictionaries(NAMES, c, max_size=4),
                           max_leaves=12)
MANIFEST_KEYS = st.sampled_from(["format", "version", "step", "time", "world_size", "kind", "hash_algo", "files",
                                 "meta", "extra"])
MEMBERS = st.sampled_from(["state.pt", "rank_0.pt", "dcp/x.bin", "dcp"])
MEMBER_OPS = st.sampled_from(["fifo", "symlink_zero", "symlink_out", "symlink_loop", "symlink_dangling", "dir",
                              "file", "truncate", "random_bytes", "flip", "delete", "rewrite_consistent"])
STEP_OPS = st.sampled_from(["fifo", "file", "symlink_to_good", "empty_dir", "no_manifest", "manifest_is_dir",
                            "manifest_fifo", "manifest_symlink_zero"])
JUNK_NAMES = st.one_of(
    st.sampled_from(["step_00000003", "step_", "step_-1", "step_1.5", "step_" + "9" * 40, "step_\u0663",
                     ".tmp.step_00000003.host.1.ab", ".prev.step_00000002.host.4000000.00",
                     ".prev.step_00000003.zz.12.ff", ".lock.step_00000002.host.1.ab", ".trash.step_00000001.h.2.0",
                     ".tmp.garbage", "latest", "manifest.json"]),
    st.text(alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=("Cs",)),
             min_size=1, max_size=20).filter(lambda n: n not in (".", ".."))
)
JUNK_KINDS = st.sampled_from(["file", "dir", "fifo", "symlink_zero", "symlink_step1"])

MUTATION = st.one_of(
    st.tuples(st.just("manifest_bytes"), st.binary(max_size=3000)),
    st.tuples(st.just("manifest_truncate"), st.integers(min_value=0, max_value=2000)),
    st.tuples(st.just("manifest_field"), MANIFEST_KEYS, JSON_VALUES),
    st.tuples(st.just("manifest_raw_field"), MANIFEST_KEYS, st.sampled_from(["NaN", "Infinity", "-Infinity",
                                                                              "1e999", "9" * 5000, '"\\u0000"'])),
    st.tuples(st.just("manifest_deep"), st.integers(min_value=1, max_value=200_000), st.sampled_from(["[", '{"a":'])),
    st.tuples(st.just("manifest_nul"), st.integers(min_value=0, max_value=2000), st.sampled_from([b"\x00", b"\\u0000"])),
    st.tuples(st.just("file_entry"), NAMES, st.one_of(st.integers(min_value=-5, max_value=2 ** 64), st.booleans(),
                                                      JSON_SCALARS), st.one_of(st.text(max_size=70), JSON_SCALARS),
              st.booleans()),
    st.tuples(st.just("member"), MEMBERS, MEMBER_OPS, st.binary(min_size=0, max_size=200)),
    st.tuples(st.just("step"), STEP_OPS),
    st.tuples(st.just("root_junk"), JUNK_NAMES, JUNK_KINDS),
)


# ----------------------------------------------------------------------------- applying mutations


def _replace(p: Path) -> None:
    """Remove whatever is at p (file, FIFO, symlink or directory)."""
    if p.is_symlink() or (p.exists() and not p.is_dir()):
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def _manifest_text(step_dir: Path):
    p = step_dir / "manifest.json"
    if p.is_symlink() or not p.is_file():  # never open a FIFO here: the harness would hang
        return None
    try:
        return json.loads(p.read_bytes())
    except Exception:
        return None


def _write(p: Path, data: bytes) -> None:
    if p.parent.is_dir() and not p.parent.is_symlink():
        _replace(p)
        p.write_bytes(data)


def apply(root: Path, good: Path, target: Path, mutation) -> None:
    kind = mutation[0]
    mpath = target / "manifest.json"
    if not target.is_dir() or target.is_symlink():
        if kind != "root_junk":
            return
    if kind == "manifest_bytes":
        _write(mpath, mutation[1])
    elif kind == "manifest_truncate":
        if mpath.is_file() and not mpath.is_symlink():
            os.truncate(mpath, min(mutation[1], mpath.stat().st_size))
    elif kind in ("manifest_field", "manifest_raw_field"):
        m = _manifest_text(target)
        if isinstance(m, dict):
            if kind == "manifest_field":
                m[mutation[1]] = mutation[2]
                text = json.dumps(m)
            else:
                m[mutation[1]] = "@@RAW@@"
                text = json.dumps(m).replace('"@@RAW@@"', mutation[2])
            _write(mpath, text.encode("utf-8", "surrogatepass"))
    elif kind == "manifest_deep":
        n, opener = mutation[1], mutation[2]
        closer = "]" if opener == "[" else "}"
        _write(mpath, (opener * n + "1" + closer * n).encode())
    elif kind == "manifest_nul":
        if mpath.is_file() and not mpath.is_symlink():
            raw = mpath.read_bytes()
            at = min(mutation[1], len(raw))
            _write(mpath, raw[:at] + mutation[2] + raw[at:])
    elif kind == "file_entry":
        m = _manifest_text(target)
        if isinstance(m, dict) and isinstance(m.get("files"), dict):
            _, name, size, digest, replace_state = mutation
            if replace_state:
                m["files"].pop("state.pt", None)
            m["files"][name] = {"size": size, "hash": digest}
            _write(mpath, json.dumps(m).encode("utf-8", "surrogatepass"))
    elif kind == "member":
        _, member, op, data = mutation
        p = target / member
        if op == "fifo":
            _replace(p)
            os.mkfifo(p) if p.parent.is_dir() else None
        elif op.startswith("symlink"):
            _replace(p)
            dest = {"symlink_zero": "/dev/zero", "symlink_out": str(good / "state.pt"),
                    "symlink_loop": str(p), "symlink_dangling": str(target / "nope")}[op]
            if p.parent.is_dir():
                os.symlink(dest, p)
        elif op == "dir":
            _replace(p)
            p.mkdir()
        elif op == "file":
            _write(p, data)
        elif op == "truncate":
            if p.is_file() and not p.is_symlink():
                os.truncate(p, min(len(data), p.stat().st_size))
        elif op == "random_bytes":
            if p.is_file() and not p.is_symlink():
                _write(p, (data * (p.stat().st_size // max(len(data), 1) + 1))[:p.stat().st_size] or b"")
        elif op == "flip":
            if p.is_file() and not p.is_symlink() and p.stat().st_size:
                raw = bytearray(p.read_bytes())
                raw[len(data) % len(raw)] ^= 0xFF
                p.write_bytes(bytes(raw))
        elif op == "delete":
            _replace(p)
        elif op == "rewrite_consistent":  # new content that the manifest agrees with: only loading can tell
            m = _manifest_text(target)
            if isinstance(m, dict) and isinstance(m.get("files"), dict) and member in m["files"]:
                _write(p, data)
                h = ck.new_hasher(m.get("hash_algo", "crc32") if m.get("hash_algo") in ck.HASH_ALGOS else "crc32")
                h.update(data)
                m["files"][member] = {"size": len(data), "hash": h.hexdigest()}
                _write(mpath, json.dumps(m).encode())
    elif kind == "step":
        op = mutation[1]
        if op == "fifo":
            _replace(target)
            os.mkfifo(target)
        elif op == "file":
            _replace(target)
            target.write_bytes(b"not a directory")
        elif op == "symlink_to_good":
            _replace(target)
            os.symlink(good, target)
        elif op == "empty_dir":
            _replace(target)
            target.mkdir()
        elif op == "no_manifest":
            _replace(mpath)
        elif op == "manifest_is_dir":
            _replace(mpath)
            mpath.mkdir()
        elif op == "manifest_fifo":
            _replace(mpath)
            os.mkfifo(mpath)
        elif op == "manifest_symlink_zero":
            _replace(mpath)
            os.symlink("/dev/zero", mpath)
    elif kind == "root_junk":
        _, name, jk = mutation
        p = root / name
        if name in ("step_00000001", "step_00000002") or os.path.lexists(p):
            return
        try:
            if jk == "file":
                p.write_bytes(b"junk")
            elif jk == "dir":
                p.mkdir()
            elif jk == "fifo":
                os.mkfifo(p)
            elif jk == "symlink_zero":
                os.symlink("/dev/zero", p)
            else:
                os.symlink(good, p)
        except (OSError, UnicodeEncodeError, ValueError):
            pass  # a name this filesystem refuses: nothing to test


class Case:
    def __init__(self, mutations):
        self.dir = Path(tempfile.mkdtemp(prefix="ckprop-"))
        self.root = self.dir / "ckpt"
        self.good = _commit(self.root, 1)
        self.target = _commit(self.root, 2)
        for mu in mutations:
            apply(self.root, self.good, self.target, mu)
        self.newest_ok = ck.verify(self.target, deep=True).ok

    def expected_latest(self) -> Path:
        return self.target if self.newest_ok else self.good

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _one_line(info: ck.CheckpointInfo) -> None:
    for p in info.problems:
        assert isinstance(p, str) and "\n" not in p and "\r" not in p, p


def each_bounded(fn):
    import functools

    @functools.wraps(fn)
    def run(*a, **kw):
        with bounded():
            return fn(*a, **kw)
    return run


# ----------------------------------------------------------------------------- library properties


@pytest.mark.timeout(300)
@PROPS
@given(st.lists(MUTATION, min_size=1, max_size=3))
@each_bounded
def test_library_never_raises_and_keeps_the_good_one(mutations):
    c = Case(mutations)
    try:
        for deep in (False, True):
            infos = ck.list_checkpoints(c.root, deep=deep)
            for i in infos:
                _one_line(i)
            found = ck.find_latest_good(c.root, deep=deep)
            assert found.latest is not None
            if deep:
                assert found.latest.path == c.expected_latest()
            for b in found.skipped:
                _one_line(b)
        for entry in os.listdir(c.root):
            _one_line(ck.verify(c.root / entry, deep=True))
        ck.dead_temporaries(c.root)
        before = ck.latest_good(c.root, deep=True)
        dry = ck.prune(c.root, keep_last=1, dry_run=True)
        assert before not in dry.remove
        ck.prune(c.root, keep_last=1)
        assert ck.latest_good(c.root, deep=True) == before
        assert ck.verify(c.good if before == c.good else before, deep=True).ok
    finally:
        c.close()


@pytest.mark.timeout(300)
@PROPS
@given(st.lists(MUTATION, min_size=1, max_size=3))
@each_bounded
def test_resume_skips_what_it_cannot_use(mutations):
    c = Case(mutations)
    try:
        # Errors here would be logged loudly; the property is about outcomes.
        logging.getLogger("clusterops").setLevel(logging.CRITICAL)
        r = sdk.resume(root=c.root, restore_rng=False)
        assert r is not None and r.step in (1, 2)
        if r.step == 1:
            assert r.path == c.good and torch.equal(r.state["w"], BIG[:16] + 1)
        r = sdk.resume(root=c.root, deep=True, restore_rng=False)
        assert r is not None and r.path == c.expected_latest() or r.step == 1
    finally:
        logging.getLogger("clusterops").setLevel(logging.NOTSET)
        c.close()


# ----------------------------------------------------------------------------- CLI properties


def _cli(runner: CliRunner, *argv: str):
    with runner.isolation() as (out, err, _):
        try:
            cli_main(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code
        return code, out.getvalue().decode("utf-8", "replace"), err.getvalue().decode("utf-8", "replace")


def _strict_json(text: str):
    def bad(c):
        raise ValueError(c)
    return json.loads(text, parse_constant=bad)


CLI_CMDS = st.sampled_from([
    ("list", "{root}"), ("list", "{root}", "--deep"), ("list", "{root}", "--json"), ("list", "{root}", "--deep", "--json"),
    ("latest", "{root}"), ("latest", "{root}", "--deep"), ("latest", "{root}", "--deep", "--json"),
    ("verify", "{target}"), ("verify", "{target}", "--deep"), ("verify", "{target}", "--deep", "--json"),
    ("verify", "{target}/manifest.json"), ("verify", "{root}/nope"),
    ("prune", "{root}", "--keep-last", "1", "--dry-run"), ("prune", "{root}", "--keep-last", "1"),
    ("prune", "{root}", "--keep-last", "1", "--json"), ("prune", "{root}/step_00000002", "--keep-last", "1"),
    ("shrink", "{target}"), ("shrink", "{target}", "--json"), ("latest", "{target}/manifest.json"),
])


@pytest.mark.timeout(300)
@PROPS
@given(st.lists(MUTATION, min_size=1, max_size=3), st.lists(CLI_CMDS, min_size=1, max_size=3))
@each_bounded
def test_cli_exits_0_1_2_without_traceback(mutations, cmds):
    c = Case(mutations)
    runner = CliRunner()
    try:
        for cmd in cmds:
            argv = ["ckpt"] + [a.format(root=c.root, target=c.target) for a in cmd]
            expect_latest = ck.latest_good(c.root, deep=True)
            code, out, err = _cli(runner, *argv)
            assert code in (0, 1, 2), (argv, code, out, err)
            assert "Traceback" not in out + err, (argv, err)
            if code == 2 or (code == 1 and cmd[0] in ("shrink", "prune", "list")):
                lines = err.strip().splitlines()
                assert len(lines) == 1 and lines[0].startswith("Error: "), (argv, err)
            if "--json" in cmd and code in (0, 1) and out.strip():
                _strict_json(out)
            if cmd[0] == "latest" and "--deep" in cmd and cmd[1] == "{root}":
                assert code == 0 and Path(out.strip().splitlines()[-1] if "--json" not in cmd
                                          else _strict_json(out)["latest"]["path"]) == expect_latest
            if cmd[0] == "prune" and code == 0:
                assert ck.latest_good(c.root, deep=True) == expect_latest
    finally:
        c.close()


def test_cli_bad_paths_are_one_line_usage_errors(tmp_path):
    runner = CliRunner()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "file").write_text("x")
    for argv in (["ckpt", "list", str(fifo)], ["ckpt", "latest", str(tmp_path / "file")],
                 ["ckpt", "prune", str(tmp_path / "nope"), "--keep-last", "1"], ["ckpt", "list", "a\x00b"],
                 ["ckpt", "prune", str(tmp_path), "--keep-last", "0"], ["ckpt", "shrink", str(fifo)],
                 ["ckpt", "verify", "a\x00b"]):
        code, out, err = _cli(runner, *argv)
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("Error: "), (argv, code, err)
    code, out, err = _cli(runner, "ckpt", "verify", str(fifo), "--deep")
    assert code == 1 and "not a directory" in err
