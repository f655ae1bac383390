"""The one place that runs external programs on this host: nothing else in clusterops
imports ``subprocess`` (tests/test_layout.py reads the source tree to keep it so). The
exception is another host's: ``clusterops.sweep.ssh`` runs the sweep's check command on
remote nodes over SSH (paramiko's ``exec_command``), with its own timeouts.

Every command is an argv list (never a shell string), runs in its own process
group under a timeout, and on timeout the whole group is killed so that no
grandchild outlives the call. A child's environment is the inherited one, plus the
runner's and the call's ``env`` entries, minus the names in ``unset``. Long-running
programs are started with ``spawn``; ``kill_group`` and ``wait_exit`` end and await
them. Each call is logged at debug level.

``Runner(as_user=NAME)`` runs every command as another local user: run by root, the argv
is prefixed with ``runuser -u NAME --`` (util-linux), which keeps the environment but
sets HOME, SHELL, USER and LOGNAME to that user's; a runner for the user this process
already is runs the argv unchanged. Anyone else asking for another user gets a
``ClusteropsError`` at once (only root can switch users without a password).
"""

from __future__ import annotations

import logging
import os
import pwd
import shlex
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Iterable, List, Mapping, Optional, Sequence, Tuple

from clusterops.errors import ClusteropsError, InputError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Completed:
    argv: tuple
    returncode: int
    stdout: str
    stderr: str
    duration_s: float

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandError(ClusteropsError):
    """A command failed: carries the argv, exit code and stderr."""

    def __init__(self, argv: Sequence[str], returncode: Optional[int], stderr: str, message: str = ""):
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        if not message:
            message = f"{shlex.join(self.argv)} exited with {returncode}"
            if tail:
                message += f": {tail}"
        super().__init__(message)


class CommandTimeout(CommandError):
    def __init__(self, argv: Sequence[str], timeout_s: float, stderr: str = ""):
        self.timeout_s = timeout_s
        super().__init__(argv, None, stderr, f"{shlex.join(list(argv))} timed out after {timeout_s:g}s")


class CommandNotFound(CommandError):
    def __init__(self, argv: Sequence[str]):
        super().__init__(argv, None, "", f"{argv[0]}: command not found")


def _stat_fields(pid: int) -> List[str]:
    """``/proc/<pid>/stat`` after the command name (which may hold spaces and parentheses):
    field 0 is the state letter, field 19 the start time."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def process_start(pid: Optional[int]) -> Optional[int]:
    """When process ``pid`` started, in clock ticks after boot (None when it is gone).

    A pid alone does not name a process for long: the kernel hands a freed pid out again once
    its counter wraps (at 32,768 on a default machine; this project's test suite, about 1,600
    processes a minute, wraps it every 20 minutes or so). The pair (pid, start) does; keep both
    for a process that must be found, or signalled, again later (``pid_alive(pid, start)``)."""
    if not pid:
        return None
    try:
        return int(_stat_fields(pid)[19])
    except (OSError, IndexError, ValueError):
        return None


def pid_alive(pid: Optional[int], start: Optional[int] = None) -> bool:
    """True while a process with this pid exists and is not a zombie; with ``start`` (from
    ``process_start``), only while it is that same process, not a later one given its pid."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        if start is None:
            return True
    try:
        fields = _stat_fields(pid)
        return fields[0] != "Z" and (start is None or int(fields[19]) == start)
    except (OSError, IndexError, ValueError):
        return False


#: What ``Runner.spawn`` returns: a started program (``poll``, ``wait``, ``pid``, ``returncode``).
Process = subprocess.Popen


def kill_group(proc, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group a spawned program leads (its children too).
    Gone already is fine."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_exit(proc, timeout_s: Optional[float]) -> Optional[int]:
    """Wait up to ``timeout_s`` for a spawned program; its exit code, or None if it still runs."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_range() -> Tuple[int, int]:
    """The kernel's ephemeral port range (Linux's default when it cannot be read)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        if 1024 <= lo <= hi <= 65535:
            return lo, hi
    except (OSError, ValueError):
        pass
    return 32768, 60999


def free_port(host: str = "") -> int:
    """A TCP port free on this machine now, for a listener that starts later (a rendezvous).

    Picked outside the kernel's ephemeral range: a port the kernel chose for a bind to port 0
    is handed out again to the next connect() or bind(0) on the machine (srun's own listeners,
    Slurm RPCs, other users' clients) in the seconds before the rendezvous binds it, and a
    client connecting to it from that port connects to itself. Outside the range only an
    explicit bind can take it. A candidate counts as free when it binds without
    SO_REUSEADDR (so a port in TIME_WAIT from an earlier attempt is passed over too); after
    64 busy candidates the kernel's own pick is the fallback."""
    import random
    import socket

    lo, hi = ephemeral_range()
    windows = [(w0, w1) for w0, w1 in ((10000, lo - 1), (hi + 1, 65535)) if w1 - w0 >= 1000]
    rng = random.SystemRandom()
    for _ in range(64 if windows else 0):
        w0, w1 = rng.choice(windows)
        port = rng.randint(w0, w1)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _child_env(base: Mapping[str, str], env: Optional[Mapping[str, str]],
               unset: Iterable[str]) -> dict:
    full_env = dict(os.environ)
    full_env.update(base)
    for name in unset:
        full_env.pop(name, None)
    if env:
        full_env.update(env)
    return full_env


RUNUSER = "/usr/sbin/runuser"   # util-linux; root only, never asks for a password


def current_user() -> str:
    """The name of the user this process runs as (effective uid)."""
    uid = os.geteuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _as_user_argv(argv: tuple, user: Optional[str]) -> tuple:
    """``argv`` run as ``user``: unchanged for the current user, else behind runuser."""
    if not user or user == current_user():
        return argv
    if os.geteuid() != 0:
        raise ClusteropsError(f"cannot run {argv[0]} as {user}: only root can switch users "
                              f"(this process runs as {current_user()})")
    try:
        pwd.getpwnam(user)
    except KeyError:
        raise ClusteropsError(f"cannot run {argv[0]} as {user}: no such local user") from None
    runuser = RUNUSER if os.path.exists(RUNUSER) else "runuser"
    return (runuser, "-u", user, "--", *argv)


def _check_argv(argv, what: str) -> tuple:
    if isinstance(argv, (str, bytes)) or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"Runner.{what} takes a list of str arguments, never a shell string")
    if not argv:
        raise TypeError(f"Runner.{what}: empty command")
    for i, a in enumerate(argv):
        if "\0" in a:
            # exec cannot pass it (the kernel ends an argument at NUL): a value from input,
            # refused as input rather than a ValueError traceback from subprocess.
            raise InputError(f"argument {i} of {os.path.basename(argv[0])!r} contains a NUL byte: {a!r:.60}")
    return tuple(argv)


@dataclass
class Runner:
    """Runs argv lists. ``env`` entries are added to the inherited environment.

    Per call, ``env`` adds entries and ``unset`` removes names from the inherited and
    the runner's environment (a call's own ``env`` entries are kept). ``as_user`` runs
    every command as that local user (see the module docstring)."""

    env: Mapping[str, str] = field(default_factory=dict)
    default_timeout_s: float = 60.0
    as_user: Optional[str] = None

    @property
    def user(self) -> str:
        """The user whose permissions the commands run with."""
        return self.as_user or current_user()

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout_s: Optional[float] = None,
        check: bool = True,
        input: Optional[str] = None,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        unset: Iterable[str] = (),
    ) -> Completed:
        argv = _check_argv(argv, "run")
        # Errors name the program asked for (argv), not the runuser in front of it.
        full_argv = _as_user_argv(argv, self.as_user)
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        full_env = _child_env(self.env, env, unset)
        log.debug("run: %s (timeout %ss)", shlex.join(full_argv), timeout_s)
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                full_argv,
                stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=full_env,
                cwd=cwd,
                start_new_session=True,  # own process group: a timeout kills it all
            )
        except FileNotFoundError:
            raise CommandNotFound(argv) from None
        try:
            out, err = proc.communicate(input=input, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc)
            out, err = proc.communicate()
            log.debug("timeout after %ss: %s", timeout_s, shlex.join(argv))
            raise CommandTimeout(argv, timeout_s, err or "") from None
        except BaseException:
            kill_group(proc)
            proc.wait()
            raise
        # The leader exited; reap anything it left behind in its group too.
        # (Daemons detach with setsid and are not touched.)
        kill_group(proc)
        if full_argv is not argv and proc.returncode != 0 and (err or "").startswith("runuser: failed to execute"):
            raise CommandNotFound(argv)   # runuser could not start it: as if exec had failed here
        done = Completed(argv, proc.returncode, out or "", err or "", time.monotonic() - start)
        log.debug("exit %s in %.3fs: %s", done.returncode, done.duration_s, argv[0])
        if check and done.returncode != 0:
            raise CommandError(argv, done.returncode, done.stderr or done.stdout)
        return done

    def spawn(
        self,
        argv: Sequence[str],
        *,
        log_path: str,
        env: Optional[Mapping[str, str]] = None,
        cwd: Optional[str] = None,
        unset: Iterable[str] = (),
    ) -> Process:
        """Start a long-running program in its own session, output appended to log_path.
        End it with ``kill_group``; await it with ``wait_exit`` (or its ``poll``)."""
        argv = _as_user_argv(_check_argv(argv, "spawn"), self.as_user)
        full_env = _child_env(self.env, env, unset)
        log.debug("spawn: %s > %s", shlex.join(argv), log_path)
        with open(log_path, "ab") as out:
            try:
                return subprocess.Popen(
                    list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                    env=full_env, cwd=cwd, start_new_session=True,
                )
            except FileNotFoundError:
                raise CommandNotFound(argv) from None
