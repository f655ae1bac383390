"""The stack capture names each rank's kernel state: a rank held by SIGSTOP says so, which
its Python stack alone (py-spy reads a stopped process as it reads a waiting one) does not."""

from __future__ import annotations

import signal
import subprocess
import time

from clusterops.supervisor import stacks


def _state_becomes(pid: int, prefix: str, timeout_s: float = 5.0) -> str:
    deadline = time.monotonic() + timeout_s
    state = stacks.proc_state(pid)
    while not state.startswith(prefix) and time.monotonic() < deadline:
        time.sleep(0.02)
        state = stacks.proc_state(pid)
    return state


def test_a_stopped_process_reads_stopped_and_a_waiting_one_sleeping():
    p = subprocess.Popen(["sleep", "30"])
    try:
        assert _state_becomes(p.pid, "S").startswith("S"), stacks.proc_state(p.pid)
        p.send_signal(signal.SIGSTOP)
        assert _state_becomes(p.pid, "T") == "T (stopped)"
        p.send_signal(signal.SIGCONT)
        assert _state_becomes(p.pid, "S").startswith("S")
    finally:
        p.kill()
        p.wait()


def test_a_gone_process_reads_unknown():
    p = subprocess.Popen(["true"])
    p.wait()
    assert stacks.proc_state(p.pid) == "unknown"
