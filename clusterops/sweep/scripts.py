"""What a sweep runs on the nodes: the check command, and the batch scripts it submits.

``check_argv`` is the per-node command (``clusterops health check --json --profile P``,
or the site's wrapper from ``--check-cmd``), with ``clusterops_argv`` saying how to start
this very clusterops on a node. The batch scripts are rendered from Jinja templates
(pure: text out).

``templates/sweep/check.sh.j2`` is the per-node check job (run the check, write its JSON,
exit code and CPU time to files named by the job id); ``templates/sweep/pair.sh.j2`` is
the 2-node all-reduce job of ``--pairs``, which takes its rendezvous address from the
one ``templates/node-address.j2`` snippet. Templates are found through
``clusterops.resources.data_dir("templates")`` (source tree, editable install or wheel);
undefined variables are errors, and every value reaches bash through the launch
package's ``shell_quote`` filter (``q``).
"""

from __future__ import annotations

import shutil
import sys
from functools import lru_cache
from pathlib import Path
from typing import List, Optional, Sequence

CHECK_TEMPLATE = "sweep/check.sh.j2"
PAIR_TEMPLATE = "sweep/pair.sh.j2"


def clusterops_argv() -> List[str]:
    """How to run this very clusterops elsewhere (absolute path: cron and Slurm jobs have a
    bare PATH)."""
    here = Path(sys.executable).parent / "clusterops"
    if here.exists():
        return [str(here)]
    found = shutil.which("clusterops")
    if found:
        return [str(Path(found).absolute())]
    return [sys.executable, "-m", "clusterops"]


def check_argv(profile: str, check_cmd: Optional[Sequence[str]] = None) -> List[str]:
    """The per-node command. ``check_cmd`` replaces ``clusterops health check --json``
    (for sites that wrap it); ``--profile`` is appended either way."""
    base = list(check_cmd) if check_cmd else clusterops_argv() + ["health", "check", "--json"]
    return base + ["--profile", profile]


@lru_cache(maxsize=1)
def _environment():
    # The built-in templates only: a site's template folders serve launchers, not these.
    from clusterops.launch.render import jinja_environment
    from clusterops.resources import data_dir

    return jinja_environment([data_dir("templates")])


def render(template: str, **context) -> str:
    """``template`` (a name under templates/) rendered with ``context``."""
    return _environment().get_template(template).render(**context)


def check_script(work_dir: Path, command: Sequence[str]) -> str:
    """The check job: runs ``command`` and leaves ``<jobid>.json``, ``.err`` and ``.done``
    (exit code, then bash's ``times``) in ``work_dir``; ``.done`` appears last."""
    return render(CHECK_TEMPLATE, work_dir=str(work_dir), command=list(command))


def pair_script(pair_dir: Path, step: Sequence[str], ib_step: Sequence[str] = ()) -> str:
    """The pair job: runs the ``srun`` argv ``step`` (``clusterops health dist`` over both
    nodes) with its report in ``pair_dir`` and ``<jobid>.done`` holding its exit code."""
    return render(PAIR_TEMPLATE, pair_dir=str(pair_dir), step=list(step), ib_step=list(ib_step))
