import os
import time

import pytest

from clusterops.errors import ClusteropsError
from clusterops.runner import CommandError, CommandNotFound, CommandTimeout, Runner, wait_exit


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


def test_unset_removes_inherited_and_runner_variables_but_keeps_the_calls_own(monkeypatch):
    monkeypatch.setenv("CLUSTEROPS_T_INHERITED", "x")
    r = Runner(env={"CLUSTEROPS_T_RUNNER": "y"})
    argv = ["sh", "-c", 'echo "${CLUSTEROPS_T_INHERITED-none} ${CLUSTEROPS_T_RUNNER-none} ${CLUSTEROPS_T_CALL-none}"']
    out = r.run(argv, unset=["CLUSTEROPS_T_INHERITED", "CLUSTEROPS_T_RUNNER", "CLUSTEROPS_T_CALL"],
                env={"CLUSTEROPS_T_CALL": "z"}).stdout
    assert out == "none none z\n"
    assert os.environ["CLUSTEROPS_T_INHERITED"] == "x"     # our own environment untouched
    assert r.run(argv).stdout == "x y none\n"


def test_spawn_unset_and_group_kill_and_wait_exit(tmp_path, monkeypatch):
    from clusterops.runner import kill_group, pid_alive, wait_exit

    monkeypatch.setenv("RANK", "7")
    log = tmp_path / "out.log"
    pidfile = tmp_path / "child.pid"
    p = Runner().spawn(["sh", "-c", f'echo "rank=${{RANK-unset}}"; sleep 60 & echo $! > {pidfile}; wait'],
                       log_path=str(log), unset=["RANK"])
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert wait_exit(p, 0.05) is None                  # still running
    child = int(pidfile.read_text())
    kill_group(p)
    assert wait_exit(p, 10) == -9
    assert log.read_text() == "rank=unset\n"
    deadline = time.monotonic() + 5
    while pid_alive(child) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not pid_alive(child), "the group kill left the grandchild running"
    kill_group(p)                                      # gone already: no error


def test_free_port_is_bindable_and_outside_the_ephemeral_range():
    import socket

    from clusterops.runner import ephemeral_range, free_port

    lo, hi = ephemeral_range()
    for _ in range(20):
        port = free_port("127.0.0.1")
        assert not lo <= port <= hi, (port, lo, hi)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_free_port_passes_over_a_port_in_use(monkeypatch):
    """With the candidate window shrunk to one busy port, the kernel's pick is the answer."""
    import random
    import socket

    from clusterops import runner

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        monkeypatch.setattr(random.SystemRandom, "randint", lambda self, a, b: taken)
        port = runner.free_port("127.0.0.1")
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ephemeral_range_falls_back_when_unreadable(monkeypatch, tmp_path):
    from clusterops import runner

    monkeypatch.setattr(runner, "EPHEMERAL_RANGE_FILE", str(tmp_path / "absent"))
    assert runner.ephemeral_range() == (32768, 60999)
    bad = tmp_path / "bad"
    bad.write_text("70000 80000\n")
    monkeypatch.setattr(runner, "EPHEMERAL_RANGE_FILE", str(bad))
    assert runner.ephemeral_range() == (32768, 60999)


# -- as_user: real runuser, real other user (nobody exists on every Debian) -------------
def _need_root():
    if os.geteuid() != 0:
        pytest.skip("switching users needs root (the suite runs as root in CI)")


def test_as_user_runs_as_that_user_and_keeps_the_environment():
    _need_root()
    r = Runner(env={"CLUSTEROPS_T": "kept"}, as_user="nobody")
    done = r.run(["sh", "-c", 'id -un; echo "$CLUSTEROPS_T"; echo "$USER"'], cwd="/")
    assert done.stdout.split() == ["nobody", "kept", "nobody"]
    assert done.argv == ("sh", "-c", 'id -un; echo "$CLUSTEROPS_T"; echo "$USER"')   # errors name sh, not runuser
    assert r.user == "nobody" and Runner().user == "root"


def test_as_user_errors_name_the_program_and_missing_is_not_found():
    _need_root()
    r = Runner(as_user="nobody")
    with pytest.raises(CommandNotFound):
        r.run(["clusterops-no-such-program-x"], cwd="/")
    with pytest.raises(CommandError) as e:
        r.run(["sh", "-c", "echo nope >&2; exit 3"], cwd="/")
    assert e.value.returncode == 3 and e.value.argv[0] == "sh" and "nope" in str(e.value)
    with pytest.raises(ClusteropsError, match="no such local user"):
        Runner(as_user="clusterops-no-such-user").run(["true"])


def test_as_user_spawn_and_as_self_is_unchanged(tmp_path):
    _need_root()
    log = tmp_path / "spawn.log"
    p = Runner(as_user="nobody").spawn(["id", "-un"], log_path=str(log), cwd="/")
    assert wait_exit(p, 10) == 0 and log.read_text().strip() == "nobody"
    assert Runner(as_user="root").run(["id", "-un"]).stdout.strip() == "root"


def test_a_nul_byte_in_an_argument_is_input_error_and_nothing_runs(tmp_path):
    """A value with a NUL (from a flag, a spec) cannot be passed to exec: refused as input
    (exit 2 at the CLI), not a ValueError traceback from subprocess, and nothing starts."""
    from clusterops.errors import InputError
    from clusterops.runner import Runner

    marker = tmp_path / "ran"
    with pytest.raises(InputError, match="NUL byte"):
        Runner().run(["touch", str(marker), "a\0b"])
    assert not marker.exists()
