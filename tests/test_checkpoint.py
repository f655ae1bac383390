"""Checkpoint commit, validation, lookup, retention, shrink and CLI, on real files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clusterops import checkpoint as ck
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
    host = ck._tmp_name(ck.TMP_PREFIX, 2).split(".")[3]
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
    with pytest.raises(ck.InputError):
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
