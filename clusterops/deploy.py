"""The Slurm-side and monitoring files for a site, written out from the installed package.

The files ship inside the package (``clusterops.site_files`` = the repository's ``slurm/``,
``clusterops.deploy_files`` = ``deploy/``; see clusterops/resources.py), so a node that got
clusterops from ``pip install`` needs no clone: ``clusterops deploy files --prefix P --out
DIR`` writes them into DIR with this install's paths filled in.

The shipped files are usable as they are for the conventional install at
``/opt/clusterops``; that is the only path they spell, and rendering replaces every
occurrence of it (the command at ``<prefix>/bin/clusterops``, the wrapper scripts at
``DIR/slurm/``). A rendered file that still names ``/opt/clusterops`` where the prefix is
elsewhere is a bug, and rendering refuses it.

The paths go unquoted into sh, a cron line, systemd ``ExecStart=`` and ``slurm.conf``, which
each quote differently (cron turns ``%`` into a newline, systemd expands ``%`` and ``$``, sh
splits on blanks), so a prefix or DIR must be a plain absolute path: letters, digits and
``. _ + @ - /``. Anything else is an input error before anything is written.

Writing never follows a symlink inside DIR and is whole or nothing for a new DIR (the
files are staged in a private directory next to it, then renamed into place). An existing
non-empty DIR is refused unless ``force``; then each file is replaced by a rename, so a
symlink planted at a file's name is replaced, not written through, and a symlinked
subdirectory is refused before anything is written.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from clusterops.errors import InputError

# The only install path the shipped files spell (the conventional install).
SHIPPED_PREFIX = "/opt/clusterops"
_PLAIN_PATH = re.compile(r"/[A-Za-z0-9._+@/-]*")


@dataclass(frozen=True)
class SiteFile:
    """One file ``deploy files`` writes: where it comes from, where it goes."""

    package: str       # data package (a key of clusterops.resources._DATA)
    source: str        # path inside that package
    out: str           # path inside DIR
    mode: int
    install: str       # what a site does with it (one line)


FILES: Sequence[SiteFile] = (
    SiteFile("site_files", "clusterops-healthcheck.sh", "slurm/clusterops-healthcheck.sh", 0o755,
             "HealthCheckProgram on every node (slurm/slurm.conf.health names it where it is)"),
    SiteFile("site_files", "prolog.sh", "slurm/prolog.sh", 0o755,
             "optional Slurm Prolog (commented out in slurm/slurm.conf.health)"),
    SiteFile("site_files", "epilog.sh", "slurm/epilog.sh", 0o755,
             "optional Slurm Epilog (commented out in slurm/slurm.conf.health)"),
    SiteFile("site_files", "slurm.conf.health", "slurm/slurm.conf.health", 0o644,
             "lines to add to slurm.conf (then `scontrol reconfigure`)"),
    SiteFile("site_files", "clusterops-sweep.cron", "cron.d/clusterops-sweep", 0o644,
             "nightly sweep from cron: install -m 0644 to /etc/cron.d/clusterops-sweep"),
    SiteFile("site_files", "clusterops-sweep.service", "systemd/clusterops-sweep.service", 0o644,
             "or from systemd: to /etc/systemd/system/ with the timer"),
    SiteFile("site_files", "clusterops-sweep.timer", "systemd/clusterops-sweep.timer", 0o644,
             "to /etc/systemd/system/, then `systemctl enable --now clusterops-sweep.timer`"),
    SiteFile("deploy_files", "grafana/clusterops-fleet.json", "grafana/clusterops-fleet.json", 0o644,
             "Grafana: Dashboards > Import (asks for the Prometheus data source)"),
    SiteFile("deploy_files", "prometheus/clusterops-alerts.yml", "prometheus/clusterops-alerts.yml", 0o644,
             "Prometheus: list it under rule_files: in prometheus.yml"),
    SiteFile("deploy_files", "prometheus/clusterops-alerts.test.yml", "prometheus/clusterops-alerts.test.yml",
             0o644, "the rules' unit tests: `promtool test rules clusterops-alerts.test.yml`"),
)
README = "README"


@dataclass(frozen=True)
class Written:
    path: str
    mode: int
    install: str

    def to_dict(self) -> dict:
        return {"path": self.path, "mode": f"{self.mode:04o}", "install": self.install}


# -- inputs ----------------------------------------------------------------------------
def default_prefix() -> str:
    """This install's prefix: the directory above the ``bin/clusterops`` that is running (a
    virtualenv, pip's ``--prefix`` or ``--user`` base), else the running interpreter's
    environment (``python -m clusterops``)."""
    argv0 = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    if os.path.basename(argv0) == "clusterops" and os.path.basename(os.path.dirname(argv0)) == "bin":
        return os.path.dirname(os.path.dirname(argv0))
    return sys.prefix


def check_prefix(prefix: str) -> str:
    """``prefix`` normalised, or an InputError naming what is wrong with it."""
    where = f"--prefix {prefix!r}"
    if not prefix or not os.path.isabs(prefix):
        raise InputError(f"{where}: not an absolute path")
    norm = os.path.normpath(prefix)
    if not _PLAIN_PATH.fullmatch(norm):
        raise InputError(f"{where}: only letters, digits and . _ + @ - / may appear (the path is written "
                         "unquoted into sh, cron, systemd and slurm.conf lines)")
    exe = os.path.join(norm, "bin", "clusterops")
    if not (os.path.isfile(exe) and os.access(exe, os.X_OK)):
        raise InputError(f"{where}: no executable {exe} (the prefix is where clusterops is installed: "
                         "the virtualenv, or pip's --prefix)")
    return norm


def check_out(out: str, force: bool) -> Path:
    """``out`` as an absolute path (symlinks in it are not resolved), or an InputError."""
    where = f"--out {out!r}"
    if not out:
        raise InputError(f"{where}: empty path")
    path = Path(os.path.abspath(out))
    if not _PLAIN_PATH.fullmatch(str(path)):
        raise InputError(f"{where}: only letters, digits and . _ + @ - / may appear (slurm.conf names "
                         "the scripts by this path)")
    if not path.parent.is_dir():
        raise InputError(f"{where}: parent directory {path.parent} does not exist")
    if not os.path.lexists(path):
        return path
    if os.path.islink(path):
        raise InputError(f"{where}: is a symlink (deploy never writes through one)")
    if not path.is_dir():
        raise InputError(f"{where}: exists and is not a directory")
    if any(path.iterdir()) and not force:
        raise InputError(f"{where}: exists and is not empty (--force replaces the files deploy writes "
                         "and leaves the rest)")
    return path


# -- rendering (pure) ------------------------------------------------------------------
def render(text: str, *, prefix: str, out: Path, name: str) -> str:
    """One shipped file with the install's paths in place of ``/opt/clusterops``."""
    marks = {"\0EXE\0": f"{prefix}/bin/clusterops", "\0SITE\0": f"{out}/slurm/", "\0DOC\0": f"file://{out}/{README}"}
    text = (text.replace(f"file://{SHIPPED_PREFIX}/docs/sweep.md", "\0DOC\0")
                .replace(f"{SHIPPED_PREFIX}/bin/clusterops", "\0EXE\0")
                .replace(f"{SHIPPED_PREFIX}/slurm/", "\0SITE\0"))
    if SHIPPED_PREFIX in text:
        raise RuntimeError(f"{name}: names {SHIPPED_PREFIX} in a way deploy does not fill in")
    for mark, value in marks.items():
        text = text.replace(mark, value)
    return text


def readme(prefix: str, out: Path, version: str) -> str:
    width = max(len(f.out) for f in FILES)
    rows = "\n".join(f"  {f.out:<{width}}  {f.install}" for f in FILES)
    return (f"Written by `clusterops deploy files` (clusterops {version}) for the install at {prefix}:\n"
            f"every file runs {prefix}/bin/clusterops, and slurm.conf names the scripts in {out}/slurm/.\n"
            "Site paths (the sweep's --work-dir, report and database) are the shipped defaults: edit them\n"
            "in the cron entry or the systemd unit.\n\n" + rows + "\n")


def rendered(prefix: str, out: Path) -> Dict[str, tuple]:
    """DIR-relative path -> (bytes, mode, install) for every file ``deploy files`` writes."""
    from clusterops import __version__
    from clusterops.resources import data_dir

    files: Dict[str, tuple] = {}
    for f in FILES:
        src = data_dir(f.package) / f.source
        try:
            text = src.read_text()
        except OSError as e:
            raise InputError(f"{src}: the installed package lacks a file it ships ({e.strerror})") from None
        files[f.out] = (render(text, prefix=prefix, out=out, name=f.source).encode(), f.mode, f.install)
    files[README] = (readme(prefix, out, __version__).encode(), 0o644, "what each file is and where it goes")
    return files


# -- writing ---------------------------------------------------------------------------
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def _open_dir(name: str, dir_fd: Optional[int], create: bool, shown: str) -> int:
    made = False
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
            made = True
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise InputError(f"--out: {shown} is a symlink or not a directory ({e.strerror}); nothing written") from None
    if made:
        os.fchmod(fd, 0o755)    # whatever the umask: every node and service reads these
    return fd


def _preflight(fd: int, files: Dict[str, tuple], shown: Path) -> None:
    """Refuse, before writing anything, a target that is a directory or a subdirectory that is
    a symlink or a file."""
    import stat

    for rel in files:
        parts = rel.split("/")
        for i, part in enumerate(parts):
            try:
                st = os.stat("/".join(parts[:i + 1]), dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                break
            last = i == len(parts) - 1
            if not last and not stat.S_ISDIR(st.st_mode):
                raise InputError(f"--out: {shown / '/'.join(parts[:i + 1])} is a symlink or not a directory; "
                                 "nothing written")
            if last and stat.S_ISDIR(st.st_mode):
                raise InputError(f"--out: {shown / rel} is a directory; nothing written")


def _write_tree(fd: int, files: Dict[str, tuple], shown: Path) -> None:
    """Write ``files`` under the directory open as ``fd``, each by a rename, never following
    a symlink."""
    for rel, (data, mode, _) in sorted(files.items()):
        *dirs, name = rel.split("/")
        fds = []
        cur = fd
        try:
            for d in dirs:
                cur = _open_dir(d, cur, True, str(shown / d))
                fds.append(cur)
            tmp = f".{name}.{secrets.token_hex(4)}.tmp"
            w = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=cur)
            try:
                with os.fdopen(w, "wb", closefd=False) as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(w)
                os.fchmod(w, mode)
            except BaseException:
                os.unlink(tmp, dir_fd=cur)
                raise
            finally:
                os.close(w)
            os.replace(tmp, name, src_dir_fd=cur, dst_dir_fd=cur)
        finally:
            for f in fds:
                os.close(f)


def write_files(*, out: str, prefix: Optional[str] = None, force: bool = False) -> List[Written]:
    """Write every site file into ``out`` for the install at ``prefix`` (default: this one)."""
    prefix = check_prefix(default_prefix() if prefix is None else prefix)
    path = check_out(out, force)
    files = rendered(prefix, path)
    if not os.path.lexists(path):
        # A new DIR: stage everything privately next to it, then one rename (all or nothing).
        stage = tempfile.mkdtemp(prefix=f".{path.name}.deploy-", dir=str(path.parent))
        try:
            sfd = os.open(stage, _DIR_FLAGS)
            try:
                _write_tree(sfd, files, path)
            finally:
                os.close(sfd)
            os.chmod(stage, 0o755)
            try:
                os.rename(stage, path)
            except OSError as e:
                raise InputError(f"--out {out!r}: appeared while writing ({e.strerror}); nothing written") from None
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    else:
        fd = _open_dir(str(path), None, False, str(path))
        try:
            _preflight(fd, files, path)
            _write_tree(fd, files, path)
        finally:
            os.close(fd)
    return [Written(str(path / rel), mode, install) for rel, (_, mode, install) in files.items()]
