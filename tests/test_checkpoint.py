"""Checkpoint commit, validation, lookup, retention, shrink and CLI, on real files."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from clusterops import checkpoint as ck
from clusterops.checkpoint import format as ckformat, writer as ckwriter
from clusterops.errors import InputError
from clusterops.cli import main as cli_main


def run_cli(capsys, *argv):
    """Run `clusterops ...` in-process; returns (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as ex:
        cli_main(list(argv))
    out, err = capsys.readouterr()
    return ex.value.code, out, err


def small_state(seed: int = 0, n: int = 1000) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(n, generator=g), "b": torch.randn(10, generator=g), "meta": {"seed": seed}}


def commit(root, step, seed=None, n=1000) -> Path:
    return ck.save_torch(root, step, {"state.pt": small_state(step if seed is None else seed, n)})


# ----------------------------------------------------------------------------- commit


def test_commit_layout_and_manifest(tmp_path):
    path = commit(tmp_path, 7)
    assert path == tmp_path / "step_00000007"
    assert sorted(os.listdir(path)) == ["manifest.json", "state.pt"]
    m = json.loads((path / "manifest.json").read_text())
    assert m["format"] == ck.FORMAT and m["step"] == 7 and m["world_size"] == 1
    entry = m["files"]["state.pt"]
    assert entry["size"] == (path / "state.pt").stat().st_size
    # hash written while saving equals a hash of the file read back
    assert entry["hash"] == ck.hash_file(path / "state.pt", m["hash_algo"])
    # no temporaries left behind, state loads back
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    assert torch.equal(ck.load_torch(path, "state.pt")["w"], small_state(7)["w"])


@pytest.mark.parametrize("algo", ["sha256", "blake2b", "crc32"])
def test_hash_algorithms_round_trip(tmp_path, algo):
    path = ck.save_torch(tmp_path, 1, {"a.pt": small_state(1, 300_000)}, algo=algo)
    assert ck.verify(path, deep=True).ok
    with open(path / "a.pt", "r+b") as f:
        f.seek(600_000)
        b = f.read(1)
        f.seek(600_000)
        f.write(bytes([b[0] ^ 0x01]))
    assert ck.verify(path).ok  # same size: only the hash can tell
    assert not ck.verify(path, deep=True).ok


def test_resave_same_step_replaces_broken_directory(tmp_path):
    commit(tmp_path, 1)
    p2 = commit(tmp_path, 2)
    (p2 / "manifest.json").unlink()
    assert ck.latest_good(tmp_path) == tmp_path / "step_00000001"
    p2b = commit(tmp_path, 2, seed=99)
    assert ck.verify(p2b, deep=True).ok
    assert ck.latest_good(tmp_path) == p2b
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_disk_full_on_small_tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], check=True)
    try:
        good = commit(mnt, 1, n=100_000)  # ~400 KB
        filler = mnt / "filler"
        with open(filler, "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
            except OSError:
                pass
        os.truncate(filler, max(0, filler.stat().st_size - 200_000))  # leave ~200 KB free
        with pytest.raises(ck.CheckpointDiskFull) as ex:
            commit(mnt, 2, n=100_000)
        assert "no space left" in str(ex.value) and "nothing committed" in str(ex.value)
        assert not (mnt / "step_00000002").exists()
        assert [n for n in os.listdir(mnt) if n.startswith(".")] == []  # temp cleaned
        assert ck.verify(good, deep=True).ok
        assert ck.latest_good(mnt, deep=True) == good
        filler.unlink()
        p3 = commit(mnt, 3, n=100_000)  # space back: saving works again
        assert ck.latest_good(mnt, deep=True) == p3
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ----------------------------------------------------------------------------- verify / lookup


@pytest.fixture
def three(tmp_path):
    return tmp_path, [commit(tmp_path, s) for s in (10, 20, 30)]


def _flip_byte(p: Path, offset: int = 100) -> None:
    with open(p, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize("damage,needs_deep,expect", [
    ("truncate", False, "truncated"),
    ("flip", True, "corrupt"),
    ("no_manifest", False, "no manifest"),
    ("bad_json", False, "not valid JSON"),
    ("missing_file", False, "missing"),
])
def test_verify_catches_damage_and_lookup_falls_back(three, capsys, damage, needs_deep, expect):
    root, paths = three
    newest = paths[-1]
    if damage == "truncate":
        os.truncate(newest / "state.pt", 50)
    elif damage == "flip":
        _flip_byte(newest / "state.pt")
    elif damage == "no_manifest":
        (newest / "manifest.json").unlink()
    elif damage == "bad_json":
        (newest / "manifest.json").write_text('{"format": ')
    elif damage == "missing_file":
        (newest / "state.pt").unlink()
    info = ck.verify(newest, deep=True)
    assert not info.ok and any(expect in p for p in info.problems), info.problems
    assert ck.verify(newest, deep=False).ok is needs_deep
    found = ck.find_latest_good(root, deep=True)
    assert found.latest.path == paths[1]
    assert [s.path for s in found.skipped] == [newest]

    code, out, err = run_cli(capsys, "ckpt", "verify", str(newest), "--deep")
    assert code == 1 and expect in err
    code, out, err = run_cli(capsys, "ckpt", "verify", str(newest))
    assert code == (0 if needs_deep else 1)
    code, out, err = run_cli(capsys, "ckpt", "latest", str(root), "--deep")
    assert code == 0 and out.strip() == str(paths[1]) and "skipped" in err


def test_lookup_ignores_temporaries_and_strangers(tmp_path):
    good = commit(tmp_path, 5)
    (tmp_path / ".tmp.step_00000009.host.1.abcd").mkdir()
    (tmp_path / "step_00000012").mkdir()          # a directory without manifest
    (tmp_path / "latest").write_text("step_00000012")  # a pointer file is never trusted
    (tmp_path / "notes.txt").write_text("x")
    assert ck.latest_good(tmp_path) == good
    assert [s for s, _ in ck.committed_steps(tmp_path)] == [5, 12]


def test_step_mismatch_is_bad(tmp_path):
    p = commit(tmp_path, 3)
    os.rename(p, tmp_path / "step_00000004")
    info = ck.verify(tmp_path / "step_00000004")
    assert not info.ok and "manifest says step 3" in info.problems[0]


def test_latest_none(tmp_path, capsys):
    code, out, err = run_cli(capsys, "ckpt", "latest", str(tmp_path))
    assert code == 1 and "no good checkpoint" in err
    code, out, err = run_cli(capsys, "ckpt", "latest", str(tmp_path / "nope"))
    assert code == 2 and "does not exist" in err


def test_cli_list_json(three, capsys):
    root, paths = three
    os.truncate(paths[0] / "state.pt", 10)
    code, out, err = run_cli(capsys, "ckpt", "list", str(root), "--json")
    assert code == 0
    data = json.loads(out)
    assert [c["step"] for c in data["checkpoints"]] == [10, 20, 30]
    assert [c["ok"] for c in data["checkpoints"]] == [False, True, True]
    code, out, err = run_cli(capsys, "ckpt", "list", str(root))
    assert "BAD" in out.splitlines()[0] and "step=30" in out


# ----------------------------------------------------------------------------- prune


def _steps(root) -> list:
    return [s for s, _ in ck.committed_steps(root)]


def test_prune_keep_last_and_every(tmp_path, capsys):
    for s in range(10, 110, 10):
        commit(tmp_path, s, n=10)
    code, out, err = run_cli(capsys, "ckpt", "prune", str(tmp_path), "--keep-last", "2", "--keep-every", "40",
                             "--dry-run")
    assert code == 0 and "would remove" in out
    assert _steps(tmp_path) == list(range(10, 110, 10))  # dry run changed nothing
    code, out, err = run_cli(capsys, "ckpt", "prune", str(tmp_path), "--keep-last", "2", "--keep-every", "40")
    assert code == 0
    assert _steps(tmp_path) == [40, 80, 90, 100]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_prune_never_removes_latest_good_even_when_newer_are_broken(tmp_path):
    for s in (1, 2, 3, 4, 5):
        commit(tmp_path, s, n=10)
    for s in (4, 5):  # the two newest are broken
        os.truncate(tmp_path / ck.step_dir_name(s) / "state.pt", 3)
    plan = ck.prune(tmp_path, keep_last=1)
    assert plan.latest_good == tmp_path / "step_00000003"
    assert _steps(tmp_path) == [3, 5]
    assert ck.latest_good(tmp_path) == tmp_path / "step_00000003"


def test_prune_cleans_dead_temporaries_only(tmp_path):
    commit(tmp_path, 1, n=10)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = ckformat._tmp_name(ck.TMP_PREFIX, 2).split(".")[3]
    dead_tmp = tmp_path / f".tmp.step_00000002.{host}.{dead.pid}.deadbeef"
    live_tmp = tmp_path / f".tmp.step_00000003.{host}.{os.getppid()}.cafe0123"  # our parent is alive
    foreign = tmp_path / ".tmp.step_00000004.otherhost.1234.00aa00aa"
    for d in (dead_tmp, live_tmp, foreign):
        d.mkdir()
        (d / "x").write_bytes(b"partial")
    old = foreign.stat().st_mtime - 10 * 3600
    plan = ck.prune(tmp_path, keep_last=5)
    assert plan.temporaries == [dead_tmp]
    assert not dead_tmp.exists() and live_tmp.exists() and foreign.exists()
    os.utime(foreign, (old, old))  # other host's writer: only its age can tell
    plan = ck.prune(tmp_path, keep_last=5)
    assert plan.temporaries == [foreign] and not foreign.exists() and live_tmp.exists()


def test_prune_bad_values(tmp_path, capsys):
    code, out, err = run_cli(capsys, "ckpt", "prune", str(tmp_path), "--keep-last", "0")
    assert code == 2
    with pytest.raises(InputError):
        ck.plan_prune(tmp_path, 1, 0)


# ----------------------------------------------------------------------------- shrink


def test_shrink_views_of_large_storages(tmp_path, capsys):
    big = torch.arange(1_000_000, dtype=torch.float32)
    state = {"view": big[:1000], "row": big.view(1000, 1000)[3], "whole": torch.ones(100), "n": 5}
    path = ck.save_torch(tmp_path, 1, {"state.pt": state, "other.bin.pt": {"x": torch.zeros(10)}})
    before = ck.verify(path).size_bytes
    assert before > 4_000_000  # torch.save wrote the whole 4 MB storage behind the views
    code, out, err = run_cli(capsys, "ckpt", "shrink", str(path), "--json")
    assert code == 0, err
    rep = json.loads(out)
    assert rep["bytes_before"] == before and rep["bytes_after"] < 100_000
    assert rep["tensors_shrunk"] == 2 and rep["files_rewritten"] == ["state.pt"]
    assert ck.verify(path, deep=True).ok
    loaded = ck.load_torch(path, "state.pt")
    assert torch.equal(loaded["view"], big[:1000]) and torch.equal(loaded["row"], big.view(1000, 1000)[3])
    assert loaded["n"] == 5
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    code, out, err = run_cli(capsys, "ckpt", "shrink", str(path))  # nothing left to shrink
    assert code == 0 and "0 tensors shrunk" in out


def test_shrink_refuses_bad_checkpoint(tmp_path, capsys):
    path = commit(tmp_path, 1)
    _flip_byte(path / "state.pt")
    code, out, err = run_cli(capsys, "ckpt", "shrink", str(path))
    assert code == 1 and "not a good checkpoint" in err


# ----------------------------------------------------------------------------- the last good one is sacred


def test_prune_after_bit_flip_in_newest_keeps_the_only_verified_good(tmp_path, capsys):
    good = commit(tmp_path, 1, n=10)
    newest = commit(tmp_path, 2, n=10)
    _flip_byte(newest / "state.pt")  # same size: only a hash check sees it
    assert ck.verify(newest).ok and not ck.verify(newest, deep=True).ok
    code, out, err = run_cli(capsys, "ckpt", "prune", str(tmp_path), "--keep-last", "1")
    assert code == 0, err
    assert _steps(tmp_path) == [1, 2]  # newest kept by --keep-last, step 1 as the latest verified good
    assert f"latest good: {good}" in out
    assert ck.latest_good(tmp_path, deep=True) == good and ck.verify(good, deep=True).ok


def test_prune_removes_no_checkpoint_when_none_passes_the_hash_check(tmp_path, capsys):
    for s in (1, 2, 3):
        commit(tmp_path, s, n=10)
        _flip_byte(tmp_path / ck.step_dir_name(s) / "state.pt")
    plan = ck.prune(tmp_path, keep_last=1)
    assert plan.remove == [] and plan.latest_good is None and "none removed" in plan.note
    assert _steps(tmp_path) == [1, 2, 3]


def test_resave_uses_rename_exchange_and_leaves_nothing_behind(tmp_path):
    commit(tmp_path, 1, seed=1)
    p = commit(tmp_path, 1, seed=2)  # the same step again: swapped in, old removed
    assert torch.equal(ck.load_torch(p, "state.pt")["w"], small_state(2)["w"])
    assert os.listdir(tmp_path) == ["step_00000001"]


def test_resave_fallback_when_the_filesystem_refuses_exchange(tmp_path, monkeypatch):
    commit(tmp_path, 1, seed=1)
    calls = []

    def refuse(src, dst, flags):  # what NFS and older filesystems answer
        calls.append(flags)
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

    monkeypatch.setattr(ckwriter, "renameat2", refuse)
    p = commit(tmp_path, 1, seed=2)
    assert calls == [ck.RENAME_EXCHANGE]
    assert torch.equal(ck.load_torch(p, "state.pt")["w"], small_state(2)["w"])
    assert os.listdir(tmp_path) == ["step_00000001"] and ck.verify(p, deep=True).ok


def test_interrupted_two_phase_replace_is_found_and_restored(tmp_path):
    old = commit(tmp_path, 5, seed=1)
    prev = tmp_path / f"{ck.PREV_PREFIX}step_00000005.{ckformat._host()}.{_dead_pid()}.0123abcd"
    os.rename(old, prev)  # what a writer killed between the two renames leaves
    found = ck.find_latest_good(tmp_path, deep=True)
    assert found.latest.path == prev and found.latest.step == 5
    plan = ck.prune(tmp_path, keep_last=1)
    assert plan.restore == [(prev, old)] and os.listdir(tmp_path) == ["step_00000005"]
    assert ck.verify(old, deep=True).ok


def test_prune_promotes_a_complete_dead_temporary_that_is_the_only_copy(tmp_path):
    commit(tmp_path, 1, n=10)
    p = commit(tmp_path, 2, n=10)
    tmp = tmp_path / f"{ck.TMP_PREFIX}step_00000002.{ckformat._host()}.{_dead_pid()}.0123abcd"
    os.rename(p, tmp)  # a writer killed after its manifest, before its rename
    plan = ck.prune(tmp_path, keep_last=1)
    assert plan.restore == [(tmp, p)] and _steps(tmp_path) == [2] and ck.verify(p, deep=True).ok


def test_new_root_parents_are_fsynced(tmp_path, monkeypatch):
    synced = []
    real = ckwriter._fsync_dir
    monkeypatch.setattr(ckwriter, "_fsync_dir", lambda d: (synced.append(Path(d)), real(d)))
    root = tmp_path / "a" / "b" / "ckpt"
    commit(root, 1, n=10)
    # every directory the save created has its entry made durable in its parent
    for d in (tmp_path, tmp_path / "a", tmp_path / "a" / "b"):
        assert d in synced


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


HOLD_LOCK = r"""
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(600)
"""


def test_live_writer_is_seen_by_its_lock_even_when_its_recorded_pid_is_dead(tmp_path):
    commit(tmp_path, 1, n=10)
    suffix = f"step_00000002.{ckformat._host()}.{_dead_pid()}.0123abcd"
    tmp = tmp_path / f"{ck.TMP_PREFIX}{suffix}"
    tmp.mkdir()
    (tmp / "x").write_bytes(b"partial")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / f"{ck.LOCK_PREFIX}{suffix}")],
                              stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline() == b"locked\n"
        assert ck.lock_state(tmp_path, suffix) == "live"
        assert ck.dead_temporaries(tmp_path) == []
        ck.prune(tmp_path, keep_last=1)
        assert tmp.exists()
    finally:
        holder.kill()
        holder.wait()
    assert ck.lock_state(tmp_path, suffix) == "free"
    ck.prune(tmp_path, keep_last=1)
    assert os.listdir(tmp_path) == ["step_00000001"]


IN_PIDNS = r"""
import os, sys
pid = int(sys.argv[2])
with open("/proc/sys/kernel/ns_last_pid", "w") as f:
    f.write(str(pid - 1))
env = dict(os.environ, CLUSTEROPS_CKPT_FAULT="files_written:sleep600")
child = os.fork()  # this process is the namespace's pid 1; the writer is the next pid
if child == 0:
    os.execve(sys.executable, [sys.executable, "-c", sys.argv[3], sys.argv[1]], env)
os.waitpid(child, 0)
"""

PIDNS_WRITER = r"""
import signal
import sys
import time
from clusterops import checkpoint as ck
p = ck.PendingCheckpoint(sys.argv[1], 2)
w = p.open_file("data.bin"); w.write(b"x" * 1000); p.finish_file("data.bin", w)
p.commit()
"""


def test_writer_in_another_pid_namespace_is_seen_as_live(tmp_path):
    """A container's writer records a pid that means nothing (or a dead process) here."""
    import shutil as sh

    if os.geteuid() != 0 or not sh.which("unshare"):
        pytest.skip("needs root and unshare(1) for a real PID namespace")
    commit(tmp_path, 1, n=10)
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    # The writer gets pid `fake` inside a fresh PID namespace (ns_last_pid), a pid that is dead out here.
    # No --mount-proc: ns_last_pid is the writer's own namespace's, and a chroot (the Debian 13
    # tier) cannot make the private mount namespace --mount-proc asks for.
    fake = next(p for p in range(pid_max - 10, pid_max // 2, -7) if not os.path.exists(f"/proc/{p}"))
    w = subprocess.Popen(["unshare", "--pid", "--fork", sys.executable, "-c", IN_PIDNS,
                          str(tmp_path), str(fake), PIDNS_WRITER], start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not any(n.startswith(ck.TMP_PREFIX) for n in os.listdir(tmp_path)):
            assert w.poll() is None, w.stderr.read().decode()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        tmp = next(tmp_path / n for n in os.listdir(tmp_path) if n.startswith(ck.TMP_PREFIX))
        assert tmp.name.split(".")[4] == str(fake) and not os.path.exists(f"/proc/{fake}")
        assert ck.dead_temporaries(tmp_path) == []   # a bare-pid check would call it dead
        ck.prune(tmp_path, keep_last=1)
        assert tmp.exists()
    finally:
        os.killpg(w.pid, signal.SIGKILL)
        w.wait()
    deadline = time.monotonic() + 10
    while ck.dead_temporaries(tmp_path) == [] and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel drops the lock when the last process of the namespace is gone
    ck.prune(tmp_path, keep_last=1)
    assert os.listdir(tmp_path) == ["step_00000001"]


# ----------------------------------------------------------------------------- weights_only


class _RunsCode:
    """Unpickling this calls open(marker, 'w'): code from the checkpoint."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_shrink_refuses_a_checkpoint_that_needs_pickled_code(tmp_path, capsys):
    from fractions import Fraction

    big = torch.arange(100_000, dtype=torch.float32)
    path = ck.save_torch(tmp_path / "a", 1, {"state.pt": {"view": big[:10], "frac": Fraction(1, 3)}})
    before = {n: (path / n).read_bytes() for n in os.listdir(path)}
    code, out, err = run_cli(capsys, "ckpt", "shrink", str(path))
    assert code == 1 and len(err.strip().splitlines()) == 1 and "--unsafe-load" in err, err
    assert {n: (path / n).read_bytes() for n in os.listdir(path)} == before  # untouched
    assert os.listdir(path.parent) == [path.name]
    code, out, err = run_cli(capsys, "ckpt", "shrink", str(path), "--unsafe-load")
    assert code == 0 and "1 tensors shrunk" in out, err
    assert ck.load_torch(path, "state.pt", weights_only=False)["frac"] == Fraction(1, 3)

    marker = tmp_path / "code-ran"
    path = ck.save_torch(tmp_path / "b", 1, {"state.pt": {"view": big[:10], "x": _RunsCode(marker)}})
    code, out, err = run_cli(capsys, "ckpt", "shrink", str(path))
    assert code == 1 and not marker.exists()  # nothing from the checkpoint ran
    with pytest.raises(ck.UnsafeLoadRefused):
        ck.load_torch(path, "state.pt")
    assert not marker.exists()


# ----------------------------------------------------------------------------- malformed step directories


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _write_manifest(path: Path, m) -> None:
    (path / "manifest.json").write_text(m if isinstance(m, str) else json.dumps(m))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind,expect", [
    ("fifo_manifest", "manifest not a regular file"),
    ("symlink_manifest", "manifest is a symlink"),
    ("fifo_member", "not a regular file"),
    ("zero_member", "is a symlink"),
    ("through_file", "path goes through a non-directory"),
    ("through_symlink", "path goes through a symlink"),
    ("nul_name", "NUL byte"),
    ("dotdot", "normalized relative path"),
    ("absolute", "absolute path"),
    ("deep_json", "nested too deep"),
    ("nan_time", "not valid JSON"),
    ("bool_size", "size or hash"),
    ("step_is_fifo", "not a directory"),
    ("step_is_symlink", "is a symlink"),
])
def test_malformed_step_is_skipped_with_reason(tmp_path, capsys, kind, expect):
    good = commit(tmp_path, 1, n=10)
    bad = commit(tmp_path, 2, n=10)
    m = _manifest(bad)
    if kind == "fifo_manifest":
        (bad / "manifest.json").unlink()
        os.mkfifo(bad / "manifest.json")
    elif kind == "symlink_manifest":
        (bad / "manifest.json").unlink()
        os.symlink(good / "manifest.json", bad / "manifest.json")
    elif kind == "fifo_member":
        (bad / "state.pt").unlink()
        os.mkfifo(bad / "state.pt")
    elif kind == "zero_member":  # a symlink to an endless device, size 0 in the manifest
        (bad / "state.pt").unlink()
        os.symlink("/dev/zero", bad / "state.pt")
        m["files"]["state.pt"]["size"] = 0
        _write_manifest(bad, m)
    elif kind == "through_file":
        m["files"]["state.pt/inner"] = m["files"].pop("state.pt")
        _write_manifest(bad, m)
    elif kind == "through_symlink":
        os.symlink(good, bad / "link")
        m["files"]["link/state.pt"] = m["files"].pop("state.pt")
        _write_manifest(bad, m)
    elif kind == "nul_name":
        m["files"]["sta\x00te.pt"] = m["files"].pop("state.pt")
        _write_manifest(bad, m)
    elif kind == "dotdot":
        m["files"]["../step_00000001/state.pt"] = m["files"].pop("state.pt")
        _write_manifest(bad, m)
    elif kind == "absolute":
        m["files"][str(good / "state.pt")] = m["files"].pop("state.pt")
        _write_manifest(bad, m)
    elif kind == "deep_json":
        _write_manifest(bad, "[" * 100_000 + "]" * 100_000)
    elif kind == "nan_time":
        _write_manifest(bad, json.dumps(m).replace(f'"time": {json.dumps(m["time"])}', '"time": NaN'))
    elif kind == "bool_size":
        m["files"]["state.pt"]["size"] = True
        _write_manifest(bad, m)
    elif kind == "step_is_fifo":
        sh_rm(bad)
        os.mkfifo(bad)
    elif kind == "step_is_symlink":
        sh_rm(bad)
        os.symlink(good, bad)
    for deep in (False, True):
        found = ck.find_latest_good(tmp_path, deep=deep)
        assert found.latest.path == good, (deep, found)
        assert len(found.skipped) == 1 and expect in found.skipped[0].problems[0], found.skipped[0].problems
    code, out, err = run_cli(capsys, "ckpt", "latest", str(tmp_path), "--deep")
    assert code == 0 and out.strip() == str(good) and expect in err and len(err.strip().splitlines()) == 1
    code, out, err = run_cli(capsys, "ckpt", "list", str(tmp_path), "--deep", "--json")
    assert code == 0 and [c["ok"] for c in json.loads(out)["checkpoints"]] == [True, False]
    code, out, err = run_cli(capsys, "ckpt", "prune", str(tmp_path), "--keep-last", "1")
    assert code == 0 and ck.verify(good, deep=True).ok


def sh_rm(p: Path) -> None:
    import shutil

    shutil.rmtree(p)


def test_odd_names_in_root_are_ignored(tmp_path, capsys):
    good = commit(tmp_path, 1, n=10)
    (tmp_path / ("step_" + "9" * 250)).mkdir()    # not an int64 step: not a checkpoint name
    (tmp_path / "step_１２").mkdir()               # non-ASCII digits
    (tmp_path / ".prev.garbage").mkdir()
    assert ck.latest_good(tmp_path) == good
    code, out, err = run_cli(capsys, "ckpt", "list", str(tmp_path))
    assert code == 0 and out.count("step=") == 1
