"""Checkpoint safety at the edges of names, prune timing and lock scope (issue 18).

- a directory whose name is not the canonical name of its step (``step_10`` beside
  ``step_00000010``) is never rewritten by number, and never makes the only copy of
  the other step look removable;
- prune re-checks each victim right before removing it: a directory re-saved by
  rename-exchange while prune hashed is not the one it judged, and stays;
- a filesystem whose flock is local to each node (Lustre ``localflock``, NFS
  ``local_lock=flock|all`` or ``nolock``) is detected from mountinfo, warned about, and
  there a free lock of another host's writer does not prove that writer dead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clusterops import checkpoint as ck
from clusterops.checkpoint import format as ckformat, locks as cklocks, retention as ckretention
from clusterops.cli import main as cli_main
from clusterops.errors import InputError


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as ex:
        cli_main(list(argv))
    out, err = capsys.readouterr()
    return ex.value.code, out, err


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fingerprint(path: Path) -> dict:
    return {n: (path / n).read_bytes() for n in sorted(os.listdir(path))}


def _viewy_checkpoint(root: Path, step: int, fill: float) -> Path:
    """A good checkpoint whose state holds a view of a larger storage (shrink rewrites it)."""
    big = torch.full((100_000,), fill)
    return ck.save_torch(root, step, {"state.pt": {"view": big[:10]}})


# ----------------------------------------------------------------------------- canonical names


def test_shrink_refuses_a_directory_that_is_not_the_canonical_name_of_its_step(tmp_path, capsys):
    root = tmp_path / "ckpt"
    real = _viewy_checkpoint(root, 10, 1.0)                      # step_00000010
    other = _viewy_checkpoint(tmp_path / "elsewhere", 10, 2.0)
    odd = root / "step_10"
    os.rename(other, odd)                                        # a valid step 10 under another spelling
    before_real, before_odd = _fingerprint(real), _fingerprint(odd)
    ino = os.lstat(real).st_ino
    code, out, err = run_cli(capsys, "ckpt", "shrink", str(odd))
    assert code == 2, (out, err)
    assert "step_10" in err and "canonical" in err and "step_00000010" in err
    assert len(err.strip().splitlines()) == 1
    # Nothing done: the unrelated step_00000010 is the same directory with the same bytes.
    assert os.lstat(real).st_ino == ino and _fingerprint(real) == before_real
    assert _fingerprint(odd) == before_odd
    assert sorted(os.listdir(root)) == ["step_00000010", "step_10"]
    with pytest.raises(InputError, match="canonical"):
        ck.shrink(odd)
    assert _fingerprint(real) == before_real
    # The canonical one still shrinks.
    assert ck.shrink(real).tensors_shrunk == 1


def test_only_copy_under_a_hidden_name_is_put_back_beside_a_non_canonical_name(tmp_path):
    """step_10 (another directory) must not make step 10's only copy look removable."""
    old = ck.save_torch(tmp_path, 10, {"state.pt": {"w": torch.arange(5.0)}})
    prev = tmp_path / f"{ck.PREV_PREFIX}step_00000010.{ckformat._host()}.{_dead_pid()}.0123abcd"
    os.rename(old, prev)       # a writer killed between the two renames of a re-save
    other = ck.save_torch(tmp_path / "x", 10, {"state.pt": {"w": torch.zeros(5)}})
    os.rename(other, tmp_path / "step_10")
    # The lookup uses the .prev. copy for step_00000010 while that name is missing.
    assert prev in [p for _, p in ck.committed_steps(tmp_path)]
    plan = ck.prune(tmp_path, keep_last=5)
    assert plan.restore == [(prev, old)]
    assert torch.equal(ck.load_torch(old, "state.pt")["w"], torch.arange(5.0))
    assert sorted(os.listdir(tmp_path)) == ["step_00000010", "step_10", "x"]


def test_hidden_names_with_a_non_canonical_step_are_not_ours():
    assert ckformat._hidden_step(".prev.step_00000010.h.1.ab") == 10
    assert ckformat._hidden_step(".prev.step_123456789.h.1.ab") == 123456789
    assert ckformat._hidden_step(".prev.step_10.h.1.ab") is None
    assert ckformat._hidden_step(".prev.step_0123456789.h.1.ab") is None
    assert ckformat.is_canonical_step_name("step_00000010")
    assert not ckformat.is_canonical_step_name("step_10")
    assert not ckformat.is_canonical_step_name("step_000000010")


# ----------------------------------------------------------------------------- prune re-checks victims


def test_prune_keeps_a_victim_that_was_re_saved_while_it_hashed(tmp_path, monkeypatch, capsys):
    ck.save_torch(tmp_path, 1, {"state.pt": {"w": torch.zeros(10)}})
    ck.save_torch(tmp_path, 2, {"state.pt": {"w": torch.ones(10)}})
    real_find = ckretention.find_latest_good

    def hash_then_resave(root, **kw):
        found = real_find(root, **kw)
        # During the long deep hash a writer re-saves step 1 (resumed from it): the
        # rename-exchange puts a new directory under the name prune already judged.
        ck.save_torch(tmp_path, 1, {"state.pt": {"w": torch.full((10,), 7.0)}})
        return found

    monkeypatch.setattr(ckretention, "find_latest_good", hash_then_resave)
    code, out, err = run_cli(capsys, "ckpt", "prune", str(tmp_path), "--keep-last", "1", "--json")
    assert code == 0, err
    import json

    doc = json.loads(out)
    step1 = str(tmp_path / "step_00000001")
    assert doc["remove"] == [] and doc["changed"] == [step1]
    assert torch.equal(ck.load_torch(step1, "state.pt")["w"], torch.full((10,), 7.0))
    assert sorted(os.listdir(tmp_path)) == ["step_00000001", "step_00000002"]
    # Unchanged victims still go.
    monkeypatch.setattr(ckretention, "find_latest_good", real_find)
    plan = ck.prune(tmp_path, keep_last=1)
    assert plan.remove == [Path(step1)] and sorted(os.listdir(tmp_path)) == ["step_00000002"]


def test_remove_tree_puts_back_a_directory_swapped_in_after_the_check(tmp_path):
    a = ck.save_torch(tmp_path, 1, {"state.pt": {"w": torch.zeros(3)}})
    judged = ckretention.identity(a)
    # The same name, another directory (what an exchange leaves).
    shutil.move(str(a), str(tmp_path / "gone"))
    b = ck.save_torch(tmp_path, 1, {"state.pt": {"w": torch.ones(3)}})
    assert ckretention._remove_tree(b, tmp_path, judged) is False
    assert ck.verify(b, deep=True).ok
    assert ckretention._remove_tree(b, tmp_path, ckretention.identity(b)) is True
    assert not b.exists()


# ----------------------------------------------------------------------------- node-local flock


MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw,errors=remount-ro
61 27 0:52 / /lustre/scratch rw,relatime - lustre 10.0.0.1@o2ib:/scratch rw,localflock,lazystatfs
62 27 0:53 / /lustre/proj rw,relatime - lustre 10.0.0.1@o2ib:/proj rw,flock,lazystatfs
70 27 0:60 / /nfs/home rw,relatime shared:40 - nfs4 fs1:/home rw,vers=4.2,local_lock=none,addr=10.0.0.2
71 27 0:61 / /nfs/scratch rw,relatime shared:41 - nfs fs2:/scratch rw,vers=3,nolock,local_lock=all
72 27 0:62 / /nfs/local\040flock rw,relatime - nfs4 fs3:/x rw,vers=4.1,local_lock=flock
73 27 0:63 / /nfs/v3 rw,relatime - nfs fs4:/v3 rw,vers=3,local_lock=none
garbage line without a separator
"""


@pytest.mark.parametrize("path, expect", [
    ("/lustre/scratch/run7/ckpt", "Lustre mounted with localflock"),
    ("/lustre/proj/run7/ckpt", None),
    ("/nfs/home/u/ckpt", None),
    ("/nfs/scratch/ckpt", "NFS mounted with local_lock=all"),
    ("/nfs/local flock/ckpt", "NFS mounted with local_lock=flock"),
    ("/nfs/v3/ckpt", None),
    ("/nfs/scratchy/ckpt", None),          # a prefix of a name is not the mount
    ("/tmp/ckpt", None),
])
def test_node_local_flock_from_recorded_mountinfo(path, expect):
    why = cklocks.node_local_flock(path, MOUNTINFO)
    if expect is None:
        assert why is None
    else:
        assert expect in why and "another host" in why


def test_nfs_nolock_is_node_local():
    text = "80 27 0:70 / /mnt/n rw - nfs srv:/n rw,vers=3,nolock\n"
    assert "nolock" in cklocks.node_local_flock("/mnt/n/ckpt", text)


def _mountinfo_for(tmp_path: Path, opts: str) -> Path:
    cklocks._scope_cache.clear()     # answers are cached for a minute per (file, root)
    f = tmp_path / "mountinfo"
    f.write_text(f"27 1 8:1 / / rw - ext4 /dev/sda1 rw\n"
                 f"61 27 0:52 / {tmp_path.resolve()}/root rw - lustre mgs:/fs rw,{opts}\n")
    return f


def _other_hosts_dead_temporary(root: Path) -> Path:
    suffix = f"step_00000002.otherhost.{_dead_pid()}.0123abcd"
    tmp = root / f"{ck.TMP_PREFIX}{suffix}"
    tmp.mkdir()
    (tmp / "x").write_bytes(b"partial")
    (root / f"{ck.LOCK_PREFIX}{suffix}").write_text("{}")   # lock file, nobody holds it here
    return tmp


def test_free_lock_of_another_host_is_not_proof_where_flock_is_node_local(tmp_path, monkeypatch, capsys):
    root = tmp_path / "root"
    ck.save_torch(root, 1, {"state.pt": {"w": torch.zeros(3)}})
    tmp = _other_hosts_dead_temporary(root)
    monkeypatch.setattr(cklocks, "MOUNTINFO", str(_mountinfo_for(tmp_path, "localflock")))
    assert ck.dead_temporaries(root) == []
    code, out, err = run_cli(capsys, "ckpt", "prune", str(root), "--keep-last", "1")
    assert code == 0 and tmp.exists()
    assert "warning:" in err and "localflock" in err
    code, out, err = run_cli(capsys, "ckpt", "list", str(root))
    assert code == 0 and "localflock" in err
    # Older than the stale age: judged dead by age, as without flock.
    assert tmp in ck.dead_temporaries(root, stale_s=-1)
    # With cluster-wide flock the free lock is proof, and prune cleans it up.
    monkeypatch.setattr(cklocks, "MOUNTINFO", str(_mountinfo_for(tmp_path, "flock")))
    code, out, err = run_cli(capsys, "ckpt", "prune", str(root), "--keep-last", "1")
    assert code == 0 and not tmp.exists() and "warning" not in err
    assert sorted(os.listdir(root)) == ["step_00000001"]


def test_writer_warns_once_per_mount(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cklocks, "MOUNTINFO", str(_mountinfo_for(tmp_path, "localflock")))
    monkeypatch.setattr(cklocks, "_warned_mounts", set())
    monkeypatch.setattr(cklocks, "_checked_roots", {})
    with caplog.at_level("WARNING", logger="clusterops.checkpoint.locks"):
        for s in (1, 2, 3):
            ck.save_torch(tmp_path / "root", s, {"state.pt": {"w": torch.zeros(3)}})
    msgs = [r.getMessage() for r in caplog.records if "localflock" in r.getMessage()]
    assert len(msgs) == 1
