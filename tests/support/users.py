"""An ordinary local user for the integration tests, and what it needs to run our Python.

``ensure_user`` creates the user once (``useradd``; idempotent: an existing user is
reused). The suite runs as root in CI, so the setup can always create it.

``python_reachable`` makes this interpreter usable by other users for the length of a
``with`` block, then puts every mode back. On this machine Python lives under ``/root``
(mode 0700), and a job of another user cannot even start it. The only change made is
``o+x`` (traverse, not list) on the directories on the interpreter's path that lack it;
nothing is made readable that was not, and library code never does this: it belongs to
the test setup alone (a site installs Python where its users reach it).

Those directories are the machine's, not one test process's: the pytest-xdist workers
(and any other session on the host) open the same /root at once. ``traversable`` keeps
one registry per machine (``TRAVERSE_REGISTRY``, under /run, behind a file lock): the
first holder records each directory's mode and opens it, later ones join, and only the
last live holder to leave restores the modes. Holders are processes (pid and start
time), so one killed inside its block (SIGKILL, a pytest timeout) is dropped by the next
holder's visit instead of keeping the path open, or closing it under the others.

``user_dir`` is a fresh directory under /tmp owned by the user (pytest's own tmp_path
lives under root's 0700 /tmp/pytest-of-root), and ``owned_by_others`` lists what in a
tree does not belong to a given uid.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

from clusterops.errors import ClusteropsError
from clusterops.runner import Runner

TEST_USER = "clusterops-user"
# One per machine and per boot (a tmpfs, like the locks in it): the modes it records are
# those of this boot's first holder. Root's under /run, like the chmod it guards; a user's
# (who can open only their own directories) under the temporary directory.
TRAVERSE_REGISTRY = (Path("/run/clusterops-tests/traverse") if os.geteuid() == 0
                     else Path(tempfile.gettempdir()) / f"clusterops-tests-{os.getuid()}" / "traverse")


def ensure_user(name: str = TEST_USER, *, system: bool = False) -> pwd.struct_passwd:
    """The local user ``name``, created with useradd when missing (a login user with a home,
    or ``system``: no home, no login shell). Test processes run at once (pytest-xdist
    workers): another may create the user at the same moment, or hold /etc/passwd's lock
    ("cannot lock /etc/passwd; try again later", exit 10), so useradd is retried until the
    user exists and only its absence in the end is an error."""
    if system:
        argv = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
    else:
        argv = ["useradd", "--create-home", "--shell", "/bin/bash",
                "--comment", "clusterops test user (tests/support/users.py)", name]
    done = None
    for attempt in range(20):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            pass
        if attempt:
            time.sleep(0.25)
        done = Runner().run(argv, timeout_s=30, check=False)
    try:
        return pwd.getpwnam(name)
    except KeyError:
        raise ClusteropsError(f"useradd {name} failed ({done.returncode}): {done.stderr.strip()}") from None


def _ancestors(path: Path) -> List[Path]:
    out = []
    for p in [path, *path.parents]:
        if p.is_dir():
            out.append(p)
    return out


def dirs_needing_traverse(paths: List[Path]) -> List[Path]:
    """Directories on the way to ``paths`` that others may not traverse (no o+x)."""
    need: Dict[Path, None] = {}
    for path in paths:
        for d in _ancestors(path):
            if not os.stat(d).st_mode & stat.S_IXOTH:
                need.setdefault(d)
    return sorted(need)


def _start_time(pid: int) -> Optional[str]:
    """A process's start time (clock ticks since boot): with the pid, who it is, so a pid
    reused by another process is not taken for a holder still inside."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@contextlib.contextmanager
def _registry(registry: Path) -> Iterator[dict]:
    """The registry's state under its lock: ``opened`` (directory -> mode before the first
    holder), ``holders`` (token -> pid, start time). Written back when the block ends."""
    registry.mkdir(mode=0o700, parents=True, exist_ok=True)
    state_path = registry / "state.json"
    with open(registry / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            state = {}
        state.setdefault("opened", {})
        state.setdefault("holders", {})
        # Holders that died inside their block never left: they hold nothing now.
        state["holders"] = {t: h for t, h in state["holders"].items()
                            if _start_time(h["pid"]) == h["start"]}
        try:
            yield state
        finally:
            # Also after a failed chmod: the modes recorded before it must not be lost.
            tmp = state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(state))
            os.replace(tmp, state_path)


@contextlib.contextmanager
def traversable(paths: Sequence[Path], registry: Path = TRAVERSE_REGISTRY) -> Iterator[List[Path]]:
    """o+x on every directory on the way to ``paths`` that lacks it, for the block, shared
    with every other holder of ``registry`` on the machine (see the module). Yields the
    directories the registry holds open now."""
    token = f"{os.getpid()}:{time.monotonic_ns()}:{id(paths)}"
    with _registry(registry) as state:
        opened = state["opened"]
        need = [d for d in dirs_needing_traverse(list(paths)) if str(d) not in opened]
        for d in need:
            opened[str(d)] = stat.S_IMODE(os.stat(d).st_mode)
        state["holders"][token] = {"pid": os.getpid(), "start": _start_time(os.getpid())}
        try:
            for d in need:
                # o+x only: other users may pass through on the way to the interpreter, not list.
                os.chmod(d, opened[str(d)] | stat.S_IXOTH)
        except BaseException:
            state["holders"].pop(token)    # never entered: the next holder to leave restores
            raise
        held = sorted(Path(d) for d in opened)
    try:
        yield held
    finally:
        with _registry(registry) as state:
            state["holders"].pop(token, None)
            if not state["holders"]:
                for d, mode in state["opened"].items():
                    try:
                        # Only a mode still ours goes back: one changed since is someone's choice.
                        if stat.S_IMODE(os.stat(d).st_mode) == mode | stat.S_IXOTH:
                            os.chmod(d, mode)
                    except FileNotFoundError:
                        pass
                state["opened"] = {}


@contextlib.contextmanager
def python_reachable(user: str) -> Iterator[List[Path]]:
    """Let ``user`` start this Python and import clusterops and torch; undo it after (the
    last holder on the machine does: ``traversable``). Yields the directories held open
    (empty when none needed it)."""
    import clusterops

    targets = [Path(os.path.realpath(sys.executable)), Path(sys.executable).absolute(),
               Path(sys.prefix), Path(sys.base_prefix), Path(clusterops.__file__).resolve().parent]
    with traversable(targets) as held:
        probe = Runner(as_user=user).run([sys.executable, "-c", "import clusterops, torch, yaml"],
                                         timeout_s=120, check=False, cwd="/")
        if probe.returncode != 0:
            raise ClusteropsError(f"user {user} cannot run {sys.executable} with clusterops and torch: "
                                  f"{probe.stderr.strip()[-300:]}")
        yield held


@contextlib.contextmanager
def user_dir(user: str, prefix: str = "clusterops-user-") -> Iterator[Path]:
    pw = pwd.getpwnam(user)
    d = Path(tempfile.mkdtemp(prefix=prefix))
    os.chown(d, pw.pw_uid, pw.pw_gid)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def owned_by_others(root: Path, uid: int) -> List[str]:
    """Paths under ``root`` (itself included) whose owner is not ``uid``."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [None, *dirnames, *filenames]:
            p = Path(dirpath) if name is None else Path(dirpath) / name
            if name is not None and p.is_dir() and not p.is_symlink():
                continue      # reached as its own dirpath
            st = os.lstat(p)
            if st.st_uid != uid:
                bad.append(f"{p} (uid {st.st_uid})")
    return bad
