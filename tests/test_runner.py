import os
import time

import pytest

from clusterops.runner import CommandError, CommandNotFound, CommandTimeout, Runner


def test_returns_output_and_code():
    r = Runner().run(["sh", "-c", "echo out; echo err >&2; exit 0"])
    assert r.ok and r.stdout == "out\n" and r.stderr == "err\n" and r.returncode == 0


def test_failure_is_typed_with_command_and_stderr():
    with pytest.raises(CommandError) as ei:
        Runner().run(["sh", "-c", "echo boom >&2; exit 3"])
    assert ei.value.returncode == 3 and "boom" in ei.value.stderr and "boom" in str(ei.value)
    assert ei.value.argv[0] == "sh"
    assert Runner().run(["sh", "-c", "exit 4"], check=False).returncode == 4


def test_shell_strings_are_refused():
    with pytest.raises(TypeError):
        Runner().run("echo hi")


def test_missing_program():
    with pytest.raises(CommandNotFound):
        Runner().run(["definitely-not-a-program-xyz"])


def test_timeout_kills_the_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # The child starts a grandchild that would outlive a plain kill of the child.
    script = f"sleep 60 & echo $! > {pidfile}; wait"
    start = time.monotonic()
    with pytest.raises(CommandTimeout) as ei:
        Runner().run(["sh", "-c", script], timeout_s=1.0)
    assert time.monotonic() - start < 10
    assert "timed out after 1s" in str(ei.value)
    grandchild = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        # A killed child may linger as a zombie until reaped by init; check its state.
        try:
            with open(f"/proc/{grandchild}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        pytest.fail("grandchild survived the timeout")


def test_env_and_input():
    r = Runner(env={"A": "1"}).run(["sh", "-c", 'read x; echo "$A$B$x"'], env={"B": "2"}, input="3\n")
    assert r.stdout == "123\n"
