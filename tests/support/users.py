"""An ordinary local user for the integration tests, and what it needs to run our Python.

``ensure_user`` creates the user once (``useradd``; idempotent: an existing user is
reused). The suite runs as root in CI, so the setup can always create it.

``python_reachable`` makes this interpreter usable by other users for the length of a
``with`` block, then puts every mode back. On this machine Python lives under ``/root``
(mode 0700), and a job of another user cannot even start it. The only change made is
``o+x`` (traverse, not list) on the directories on the interpreter's path that lack it;
nothing is made readable that was not, and library code never does this: it belongs to
the test setup alone (a site installs Python where its users reach it).

``user_dir`` is a fresh directory under /tmp owned by the user (pytest's own tmp_path
lives under root's 0700 /tmp/pytest-of-root), and ``owned_by_others`` lists what in a
tree does not belong to a given uid.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import stat
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, Iterator, List

from clusterops.errors import ClusteropsError
from clusterops.runner import Runner

TEST_USER = "clusterops-user"


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


@contextlib.contextmanager
def python_reachable(user: str) -> Iterator[List[Path]]:
    """Let ``user`` start this Python and import clusterops and torch; undo it after.
    Yields the directories that were changed (empty when none needed it)."""
    import clusterops

    targets = [Path(os.path.realpath(sys.executable)), Path(sys.executable).absolute(),
               Path(sys.prefix), Path(sys.base_prefix), Path(clusterops.__file__).resolve().parent]
    changed = {d: os.stat(d).st_mode for d in dirs_needing_traverse(targets)}
    try:
        for d, mode in changed.items():
            # o+x only: other users may pass through on the way to the interpreter, not list.
            os.chmod(d, stat.S_IMODE(mode) | stat.S_IXOTH)
        probe = Runner(as_user=user).run([sys.executable, "-c", "import clusterops, torch, yaml"],
                                         timeout_s=120, check=False, cwd="/")
        if probe.returncode != 0:
            raise ClusteropsError(f"user {user} cannot run {sys.executable} with clusterops and torch: "
                                  f"{probe.stderr.strip()[-300:]}")
        yield sorted(changed)
    finally:
        for d, mode in changed.items():
            os.chmod(d, stat.S_IMODE(mode))


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
