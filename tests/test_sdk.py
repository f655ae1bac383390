"""The training SDK: heartbeat, stop requests, RNG capture, save/resume, async save."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from clusterops import checkpoint as ck
from clusterops import protocol, sdk

REPO = Path(__file__).resolve().parent.parent


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


# ----------------------------------------------------------------------------- heartbeat


def test_heartbeat_rate_limited_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(tmp_path))
    monkeypatch.setattr(sdk, "HEARTBEAT_INTERVAL_S", 0.2)
    f = tmp_path / "rank0"
    assert sdk.heartbeat(1) is True
    assert f.read_text().strip() == "1"
    writes = sum(sdk.heartbeat(s) for s in range(2, 5000))  # a tight loop: at most a few writes
    assert writes <= 2
    time.sleep(0.25)
    assert sdk.heartbeat(5001) is True and f.read_text().strip() == "5001"
    assert sdk.heartbeat(5002, force=True) is True and f.read_text().strip() == "5002"
    assert sorted(os.listdir(tmp_path)) == ["rank0"]  # no temp file left


def test_heartbeat_without_env_is_noop_and_never_raises(tmp_path, monkeypatch):
    assert sdk.heartbeat(3) is False
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(tmp_path / "missing"))
    assert sdk.heartbeat(3) is False  # logged, training goes on


def test_heartbeat_uses_rank(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(tmp_path))
    monkeypatch.setenv("SLURM_PROCID", "3")
    sdk.heartbeat(9)
    assert (tmp_path / "rank3").read_text().strip() == "9"


# ----------------------------------------------------------------------------- stop requests


def test_stop_file(tmp_path, monkeypatch):
    stop = tmp_path / "stop"
    monkeypatch.setenv(protocol.ENV_STOP_FILE, str(stop))
    monkeypatch.setattr(sdk, "STOP_FILE_POLL_S", 0.0)
    sdk.init_distributed()
    assert sdk.should_stop() is False
    stop.touch()
    assert sdk.should_stop() is True
    stop.unlink()
    assert sdk.should_stop() is True  # latched: a stop is not taken back
    assert sdk.stop_reason() == "stop file"


def test_stopped_marker(tmp_path, monkeypatch):
    hb = tmp_path / "hb"
    hb.mkdir()
    stop = tmp_path / "stop"
    monkeypatch.setenv(protocol.ENV_STOP_FILE, str(stop))
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(tmp_path / "ck"))
    monkeypatch.setattr(sdk, "STOP_FILE_POLL_S", 0.0)
    sdk.init_distributed()
    assert sdk.mark_stopped(1) is False  # no heartbeat directory: not under the supervisor
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(hb))
    state = {"w": torch.zeros(3)}
    sdk.save(state, 1)  # a save writes no marker
    assert protocol.read_stopped(hb) is None and protocol.training_stopped(tmp_path) is None
    protocol.request_stop(stop)
    assert sdk.should_stop() is True
    path = sdk.save(state, 2)
    assert protocol.read_stopped(hb) is None
    assert sdk.mark_stopped(2, path) is True
    assert protocol.read_stopped(hb) == {"step": 2, "path": str(path), "reason": "stop file"}
    assert sdk.mark_stopped(3) is False  # once
    assert protocol.read_stopped(hb)["step"] == 2
    assert sorted(os.listdir(hb)) == [protocol.STOPPED_MARKER]


def test_stopped_marker_only_from_rank_0(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(tmp_path))
    monkeypatch.setenv("SLURM_PROCID", "1")  # a world of one is not initialized: rank from the env
    sdk.request_stop("test")
    assert sdk.mark_stopped(5) is False and os.listdir(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGUSR2, signal.SIGTERM, signal.SIGUSR1])
def test_stop_signals(sig):
    sdk.init_distributed()
    assert sdk.should_stop() is False
    os.kill(os.getpid(), sig)
    time.sleep(0.05)
    assert sdk.should_stop() is True
    assert sdk.stop_reason() == sig.name


def test_lead_time_signal_is_a_stop_request_when_started_ignored():
    """torchrun's workers inherit SIGUSR1 ignored from the launcher: the SDK's handler replaces it.

    Without a supervisor as well: nothing in the environment but the signal.
    """
    code = textwrap.dedent("""
        import os, signal, time
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)   # what `trap "" USR1` hands down
        from clusterops import sdk
        sdk.install_stop_handlers()
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
        print(sdk.should_stop(), sdk.stop_reason(), flush=True)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLUSTEROPS_")}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout.strip()) == (0, "True SIGUSR1"), p.stderr


def test_second_sigterm_kills(tmp_path):
    code = textwrap.dedent("""
        import os, signal, time
        from clusterops import sdk
        sdk.init_distributed()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        print("first", sdk.should_stop(), flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived", flush=True)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.strip() == "first True" and p.returncode == -signal.SIGTERM


# ----------------------------------------------------------------------------- RNG, save, resume


def _draw():
    return (random.random(), float(np.random.rand()), float(torch.rand(1)))


def test_rng_round_trip():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    _draw()
    np.random.normal()  # leaves a cached gaussian in numpy's state
    state = sdk.get_rng_state()
    expected = [_draw() for _ in range(3)]
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    sdk.set_rng_state(state)
    assert [_draw() for _ in range(3)] == expected


def test_save_and_resume_single_process(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(tmp_path))
    assert sdk.resume() is None
    torch.manual_seed(5)
    state = {"w": torch.randn(50), "data": {"epoch": 2, "batch": 7}}
    path = sdk.save(state, 40, rank_state={"mine": 1})
    assert path == tmp_path / "step_00000040"
    expected = _draw()
    torch.manual_seed(0), random.seed(0), np.random.seed(0)
    r = sdk.resume()
    assert r.step == 40 and r.path == path and r.rng_restored
    assert torch.equal(r.state["w"], state["w"]) and r.state["data"] == {"epoch": 2, "batch": 7}
    assert r.rank_state == {"mine": 1}
    assert _draw() == expected  # the RNG continues exactly where save() captured it


def test_resume_falls_back_past_bad_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(tmp_path))
    for s in (10, 20, 30):
        sdk.save({"w": torch.full((4,), float(s))}, s)
    os.truncate(tmp_path / "step_00000030" / "state.pt", 20)
    (tmp_path / "step_00000020" / "manifest.json").unlink()
    r = sdk.resume()
    assert r.step == 10 and float(r.state["w"][0]) == 10.0


def test_resume_from_env_and_fallback(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(tmp_path))
    for s in (10, 20):
        sdk.save({"w": torch.full((4,), float(s))}, s)
    monkeypatch.setenv(protocol.ENV_RESUME_FROM, str(tmp_path / "step_00000010"))
    assert sdk.resume().step == 10  # the supervisor's choice wins
    with open(tmp_path / "step_00000010" / "state.pt", "r+b") as f:
        f.seek(64)
        f.write(b"\xff\xfe")
    assert sdk.resume(deep=True).step == 20  # named checkpoint is bad: latest good instead


def test_save_without_root_is_a_clear_error():
    with pytest.raises(sdk.ClusteropsError, match="CLUSTEROPS_CKPT_DIR"):
        sdk.save({"w": torch.zeros(1)}, 1)


# ----------------------------------------------------------------------------- async


def test_async_save_snapshot_and_one_in_flight(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(tmp_path))
    monkeypatch.setenv(ck.FAULT_ENV, "files_written:sleep1.0")  # a slow disk
    w = torch.zeros(1000)
    t0 = time.monotonic()
    assert sdk.save({"w": w}, 1, async_=True) is None
    blocked_s = time.monotonic() - t0
    assert sdk.async_in_flight() and blocked_s < 0.9
    w += 1.0  # training goes on and changes the live tensor
    assert not (tmp_path / "step_00000001").exists()
    t1 = time.monotonic()
    sdk.save({"w": w}, 2, async_=True)  # waits for save 1 first: at most one in flight
    assert time.monotonic() - t1 > 0.3
    assert ck.verify(tmp_path / "step_00000001", deep=True).ok
    assert not (tmp_path / "step_00000002").exists()
    assert sdk.wait() == tmp_path / "step_00000002"
    assert float(ck.load_torch(tmp_path / "step_00000001", "state.pt")["w"][0]) == 0.0  # snapshot
    assert float(ck.load_torch(tmp_path / "step_00000002", "state.pt")["w"][0]) == 1.0
    assert not sdk.async_in_flight()


def test_async_failure_surfaces_on_next_save(tmp_path, monkeypatch):
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(tmp_path))
    monkeypatch.setenv(ck.FAULT_ENV, "files_written:enospc")
    assert sdk.save({"w": torch.zeros(10)}, 1, async_=True) is None
    with pytest.raises(ck.CheckpointDiskFull, match="no space left"):
        sdk.save({"w": torch.zeros(10)}, 2, async_=True)
    monkeypatch.delenv(ck.FAULT_ENV)
    assert sdk.save({"w": torch.zeros(10)}, 3) == tmp_path / "step_00000003"  # training can go on
    assert [s for s, _ in ck.committed_steps(tmp_path)] == [3]
    assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_async_failure_surfaces_on_wait(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv(protocol.ENV_CKPT_DIR, str(blocker / "ckpts"))
    sdk.save({"w": torch.zeros(10)}, 1, async_=True)
    with pytest.raises(ck.CheckpointError, match="step 1 not saved"):
        sdk.wait()
    assert sdk.wait() is None  # reported once


def test_async_save_in_flight_at_exit_is_committed(tmp_path):
    code = textwrap.dedent("""
        import os, torch
        from clusterops import sdk
        os.environ["CLUSTEROPS_CKPT_FAULT"] = "files_written:sleep0.5"
        sdk.save({"w": torch.ones(1000)}, 5, async_=True)
        print("exiting", sdk.async_in_flight(), flush=True)
    """)
    env = dict(os.environ, CLUSTEROPS_CKPT_DIR=str(tmp_path))
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "exiting True", p.stderr
    assert ck.verify(tmp_path / "step_00000005", deep=True).ok
