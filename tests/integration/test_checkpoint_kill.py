"""kill -9 of a real writer process at every point of a save.

A subprocess saves checkpoint step 2 over a root that holds a good step 1; the
CLUSTEROPS_CKPT_FAULT hook makes it SIGSTOP itself at a named point (the test then
kills it with SIGKILL from outside) or SIGKILL itself there. Afterwards the latest
good checkpoint (hashes checked) must be step 1 or step 2 — never a broken one —
every committed directory must verify, and a new save must work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from clusterops import checkpoint as ck

# The writer with torch.save (one case: it takes seconds to import torch on 2 cores).
TORCH_WRITER = r"""
import sys, torch
from clusterops import checkpoint as ck
root, step = sys.argv[1], int(sys.argv[2])
g = torch.Generator().manual_seed(step)
state = {"a": torch.randn(1_000_000, generator=g), "b": torch.randn(1000, generator=g)}
ck.save_torch(root, step, {"state.pt": state, "extra.pt": {"step": step, "t": torch.ones(10)}})
print("saved", flush=True)
"""

# The same commit protocol with plain bytes (PendingCheckpoint is what save_torch and
# the SDK use underneath): a fast process, so every point is covered cheaply.
BYTES_WRITER = r"""
import os, sys
from clusterops import checkpoint as ck
root, step = sys.argv[1], int(sys.argv[2])
payload = os.urandom(4 << 20)
pending = ck.PendingCheckpoint(root, step)
half = len(payload) // 2 if ck.fault_armed("mid_write") else None
w = pending.open_file("data.bin", fault_at_bytes=half)
for i in range(0, len(payload), 1 << 20):
    w.write(payload[i:i + (1 << 20)])
pending.finish_file("data.bin", w)
w = pending.open_file("sub/meta.bin")
w.write(b"meta" * 100)
pending.finish_file("sub/meta.bin", w)
pending.commit()
print("saved", flush=True)
"""

POINTS_BEFORE = ["begin", "mid_write", "files_written", "mid_manifest", "manifest_written"]
POINTS_AFTER = ["renamed", "committed"]


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _run_writer(root, step, fault: str, writer: str):
    env = dict(os.environ, CLUSTEROPS_CKPT_FAULT=fault)
    p = subprocess.Popen([sys.executable, "-c", writer, str(root), str(step)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if fault.endswith(":stop"):
        deadline = time.monotonic() + 60
        while _proc_state(p.pid) != "T":
            assert p.poll() is None, p.stderr.read().decode()
            assert time.monotonic() < deadline, "writer never reached the fault point"
            time.sleep(0.02)
        os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)
    assert p.returncode == -signal.SIGKILL
    return p


CASES = [(p, "stop", "bytes") for p in POINTS_BEFORE + POINTS_AFTER] + [
    ("mid_manifest", "kill", "bytes"), ("renamed", "kill", "bytes"), ("mid_write", "kill", "torch")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point,action,writer", CASES)
def test_kill9_during_save_never_leaves_a_broken_latest(tmp_path, point, action, writer):
    import torch

    first = ck.save_torch(tmp_path, 1, {"state.pt": {"a": torch.zeros(1000)}})
    _run_writer(tmp_path, 2, f"{point}:{action}", TORCH_WRITER if writer == "torch" else BYTES_WRITER)

    found = ck.find_latest_good(tmp_path, deep=True)
    expected = first if point in POINTS_BEFORE else tmp_path / "step_00000002"
    assert found.latest is not None and found.latest.path == expected
    assert found.skipped == []  # nothing half-written ever carries a step_<N> name
    for _, path in ck.committed_steps(tmp_path):
        assert ck.verify(path, deep=True).ok
    if point in POINTS_BEFORE and point != "begin":
        assert ck.dead_temporaries(tmp_path), "the dead save's temporary should be visible to prune"
    # retention cleans the dead save's leftovers; a new save of the same step works
    ck.prune(tmp_path, keep_last=10)
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []
    ck.save_torch(tmp_path, 2, {"state.pt": {"a": torch.ones(1000)}})
    assert ck.latest_good(tmp_path, deep=True) == tmp_path / "step_00000002"


DCP_WRITER = r"""
import os, sys, torch
from clusterops import sdk
d = sdk.init_distributed()
root, fault = sys.argv[1], sys.argv[2]
state = {"w": torch.arange(100_000.0) + d.rank * 0, "opt": {"lr": 0.1}}
sdk.save(state, 1, root=root)
print(f"rank {d.rank} saved 1", flush=True)
os.environ["CLUSTEROPS_CKPT_FAULT"] = fault
sdk.save(state, 2, root=root)
print(f"rank {d.rank} saved 2", flush=True)
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("point", ["manifest_written", "renamed"])
def test_kill9_during_multi_rank_save(tmp_path, point):
    """Two ranks (torchrun, gloo, torch.distributed.checkpoint): a rank dies mid-save."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    script = tmp_path / "writer.py"
    script.write_text(DCP_WRITER)
    root = tmp_path / "ck"
    p = subprocess.run([torchrun, "--standalone", "--nproc-per-node=2", str(script), str(root), f"{point}:kill"],
                       capture_output=True, text=True, timeout=150)
    assert p.returncode != 0 and "saved 1" in p.stdout and "saved 2" not in p.stdout, p.stdout + p.stderr[-2000:]
    found = ck.find_latest_good(root, deep=True)
    expected = 2 if point == "renamed" else 1
    assert found.latest is not None and found.latest.step == expected and found.skipped == []
    m = found.latest.manifest
    assert m["kind"] == "dcp" and m["world_size"] == 2 and {"rank_0.pt", "rank_1.pt"} <= set(m["files"])


# ----------------------------------------------------------------------------- re-saving an existing step

# Re-saves step 1 (which already exists) with payload generation GEN; with --loop it
# re-saves over and over (gen 1, 2, ...) so a kill from outside lands at any instant.
RESAVE_WRITER = r"""
import os, sys
from clusterops import checkpoint as ck
root, loop = sys.argv[1], sys.argv[2] == "loop"
def save(gen):
    pending = ck.PendingCheckpoint(root, 1)
    half = 32768 if ck.fault_armed("mid_write") else None
    w = pending.open_file("data.bin", fault_at_bytes=half)
    w.write(gen.to_bytes(8, "little") * 8192)
    pending.finish_file("data.bin", w)
    w = pending.open_file("sub/gen.txt")
    w.write(str(gen).encode())
    pending.finish_file("sub/gen.txt", w)
    pending.commit()
print("ready", flush=True)
gen = 1
while True:
    save(gen)
    print(f"saved {gen}", flush=True)
    if not loop:
        break
    gen += 1
"""


def _gen_of(path) -> int:
    return int((path / "sub" / "gen.txt").read_text())


def _seed_old(root):
    pending = ck.PendingCheckpoint(root, 1)
    w = pending.open_file("data.bin")
    w.write((0).to_bytes(8, "little") * 8192)
    pending.finish_file("data.bin", w)
    w = pending.open_file("sub/gen.txt")
    w.write(b"0")
    pending.finish_file("sub/gen.txt", w)
    return pending.commit()


def _check_resave_invariant(root, *, fallback: bool) -> int:
    """After a kill: step 1 is the old (gen g) or the new (gen g+1) complete copy."""
    final = root / "step_00000001"
    found = ck.find_latest_good(root, deep=True)
    assert found.latest is not None and found.latest.step == 1 and found.skipped == [], found
    if not fallback:
        # rename-exchange: the name is never missing, whatever the instant
        assert found.latest.path == final
    else:
        assert found.latest.path == final or found.latest.path.name.startswith(ck.PREV_PREFIX)
    data = (found.latest.path / "data.bin").read_bytes()
    gen = _gen_of(found.latest.path)
    assert data == gen.to_bytes(8, "little") * 8192
    return gen


RESAVE_POINTS_OLD = ["begin", "mid_write", "files_written", "mid_manifest", "manifest_written", "exchange"]
RESAVE_POINTS_NEW = ["renamed", "committed"]


RESAVE_CASES = ([(p, False) for p in RESAVE_POINTS_OLD + RESAVE_POINTS_NEW]
                + [(p, True) for p in RESAVE_POINTS_OLD + ["prev_moved"] + RESAVE_POINTS_NEW])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("point,fallback", RESAVE_CASES,
                         ids=[f"{p}-{'two-phase' if f else 'exchange'}" for p, f in RESAVE_CASES])
def test_kill9_during_resave_of_existing_step(tmp_path, point, fallback):
    _seed_old(tmp_path)
    fault = f"{point}:stop"
    if fallback:  # the filesystem refuses RENAME_EXCHANGE as NFS does (EINVAL)
        fault += ",exchange:einval"
    env = dict(os.environ, CLUSTEROPS_CKPT_FAULT=fault)
    p = subprocess.Popen([sys.executable, "-c", RESAVE_WRITER, str(tmp_path), "once"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while _proc_state(p.pid) != "T":
        assert p.poll() is None, p.stderr.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # While the writer is stopped (alive), its lock keeps prune off its temporaries.
    live = ck.scan_leftovers(tmp_path).live
    if point not in ("committed",):
        assert live, os.listdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    ck.prune(tmp_path, keep_last=5)
    assert sorted(os.listdir(tmp_path)) == before
    os.kill(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)

    gen = _check_resave_invariant(tmp_path, fallback=fallback)
    assert gen == (1 if point in RESAVE_POINTS_NEW else 0), (point, gen)
    if point == "prev_moved":
        assert not (tmp_path / "step_00000001").exists()  # the gap the fallback has ...
    # ... which the next prune (or save) closes: the old copy is put back, leftovers go.
    plan = ck.prune(tmp_path, keep_last=5)
    if point == "prev_moved":
        assert [b.name for _, b in plan.restore] == ["step_00000001"]
    assert sorted(os.listdir(tmp_path)) == ["step_00000001"]
    assert _gen_of(tmp_path / "step_00000001") == gen and ck.verify(tmp_path / "step_00000001", deep=True).ok
    # and a re-save after all that works
    env = dict(os.environ)
    env.pop(ck.FAULT_ENV, None)
    subprocess.run([sys.executable, "-c", RESAVE_WRITER, str(tmp_path), "once"], env=env, check=True, timeout=60)
    assert _gen_of(tmp_path / "step_00000001") == 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fallback", [False, True], ids=["exchange", "two-phase"])
def test_kill9_at_random_instants_of_repeated_resaves(tmp_path, fallback):
    """A writer re-saves step 1 in a loop; kill -9 lands at 25 random instants."""
    import random

    rng = random.Random(1234 + fallback)
    _seed_old(tmp_path)
    env = dict(os.environ)
    env.pop(ck.FAULT_ENV, None)
    if fallback:
        env[ck.FAULT_ENV] = "exchange:einval"
    gens, mid_save = [], 0
    for _ in range(25):
        p = subprocess.Popen([sys.executable, "-c", RESAVE_WRITER, str(tmp_path), "loop"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert p.stdout.readline() == b"ready\n", p.stderr.read().decode()
        time.sleep(rng.uniform(0.0, 0.15))
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)
        gens.append(_check_resave_invariant(tmp_path, fallback=fallback))
        mid_save += len(os.listdir(tmp_path)) > 1
        ck.prune(tmp_path, keep_last=5)
        assert sorted(os.listdir(tmp_path)) == ["step_00000001"]
        assert ck.verify(tmp_path / "step_00000001", deep=True).ok
    print(f"kills that left a save in progress: {mid_save}/25; generations reached: {gens}")
    assert max(gens) > 0 and mid_save > 0  # the kills did land after commits and inside saves
