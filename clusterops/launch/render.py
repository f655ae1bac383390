"""Rendering: a JobSpec -> the text of its sbatch script (pure: reads templates, writes nothing).

Templates are Jinja2 files (``<launcher>.sh.j2`` extending ``base.sh.j2``), found by
``clusterops.launch.templates`` (the ``--templates`` directories, ``$CLUSTEROPS_TEMPLATES``,
the built-in ``templates/``). The environment uses StrictUndefined (a name a
template does not get is an error, not an empty string), and every value that reaches the
shell goes through a quoting filter: ``q`` (bash), ``sbatch_q`` (an ``#SBATCH`` line),
``slurm_filename`` (``%`` in paths) and ``one_line`` (comments). A template failure is one
line naming the template file and line.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from clusterops import schema
from clusterops.errors import InputError
from clusterops.launch.spec import JobSpec
from clusterops.launch.templates import TEMPLATE_SUFFIX, list_templates, template_search_path

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def shell_quote(value: Any) -> str:
    """Quote one value for bash (single quotes; safe for every byte but NUL)."""
    if isinstance(value, bool):
        value = "true" if value else "false"
    s = str(value)
    if "\x00" in s:
        raise ValueError("a NUL byte cannot be passed to a program")
    return shlex.quote(s)


def sbatch_quote(value: Any) -> str:
    """Quote a value for an ``#SBATCH`` line.

    sbatch reads directives with its own small parser, not bash: double quotes group
    words, a backslash escapes the next character, and an unquoted ``#`` starts a
    comment. Single quotes mean nothing to it. Newlines cannot be carried at all.
    """
    s = str(value)
    if _CONTROL.search(s):
        raise ValueError(f"control characters cannot go into an #SBATCH line: {s!r}")
    if re.fullmatch(r"[A-Za-z0-9_@%+=:,./\[\]-]+", s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def slurm_filename(value: Any) -> str:
    """Escape '%' so Slurm's filename patterns (%j, %N...) leave a path alone."""
    return str(value).replace("%", "%%")


def one_line(value: Any) -> str:
    """Printable one-line form for comments: a newline must never end a comment early."""
    return _CONTROL.sub("?", str(value))


def jinja_environment(search: Sequence[str | os.PathLike]):
    """The one Jinja environment for every script clusterops generates (launchers and the
    sweep's job scripts): StrictUndefined, no autoescape, and the quoting filters."""
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(d) for d in search]),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["q"] = shell_quote
    env.filters["sbatch_q"] = sbatch_quote
    env.filters["slurm_filename"] = slurm_filename
    env.filters["one_line"] = one_line
    return env


def _environment(site_dirs: Sequence[str | os.PathLike] = ()):
    return jinja_environment([d for d, _ in template_search_path(site_dirs)])


#: Where a supervised job's resolved spec goes when the script is written to a file:
#: ``<script>.supervise.json`` beside it (see :func:`supervise_spec_text`).
SPEC_FILE_SUFFIX = ".supervise.json"


def supervise_spec_text(spec: JobSpec) -> str:
    """The resolved spec the supervisor reads (``--spec-json`` or ``--spec-file``): compact JSON."""
    return json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))


def spec_file_for(script_path: str | os.PathLike) -> str:
    """The spec file that goes with a script written at ``script_path`` (an absolute path:
    Slurm runs a copy of the script from its spool directory, not from where it was written)."""
    return os.path.abspath(os.fspath(script_path)) + SPEC_FILE_SUFFIX


def _inline_spec_problem(spec: JobSpec) -> Optional[str]:
    """Why the spec cannot ride on the ``exec clusterops supervise --spec-json`` line, or None.

    That line is one execve: the JSON is a single argument (MAX_ARG_STRLEN), and it starts
    with the job's env: exported besides, so both count against ARG_MAX."""
    from clusterops.launch.spec import ARG_RESERVE_BYTES, MAX_ARG_STRLEN, arg_max_bytes

    size = len(supervise_spec_text(spec).encode()) + len("--spec-json") + 2
    env = sum(len(f"{k}={v}".encode()) + 1 for k, v in spec.env)
    if size > MAX_ARG_STRLEN or size + env > arg_max_bytes() - ARG_RESERVE_BYTES:
        return (f"the resolved spec is {size} bytes, too large for the `exec clusterops supervise` line "
                f"(one argument is limited to {MAX_ARG_STRLEN - 1} bytes by the kernel); write the script "
                f"with -o FILE (the spec then goes to FILE{SPEC_FILE_SUFFIX}) or use `launch submit`")
    return None


def render_context(spec: JobSpec, spec_file: Optional[str] = None) -> Dict[str, Any]:
    """Everything a template sees (plain values)."""
    from clusterops import __version__

    return {
        "spec": spec,
        "version": __version__,
        "nproc_per_node": spec.procs_per_node,
        "world_size": spec.world_size,
        "tasks_per_node": spec.tasks_per_node,
        "alloc_tasks_per_node": spec.alloc_tasks_per_node,
        "alloc_nodes": spec.alloc_nodes,
        "env": list(spec.env),
        "supervise": spec.supervise_dict,
        "spec_json": supervise_spec_text(spec),
        "spec_file": spec_file,
        "python_script": spec.script.endswith(".py"),
    }


def _template_error(e: Exception, search: List[Path]) -> InputError:
    """One line naming the template file and line of a Jinja failure."""
    import jinja2

    filename = getattr(e, "filename", None)
    lineno = getattr(e, "lineno", None)
    if not filename:
        tb = e.__traceback__
        while tb is not None:
            fn = tb.tb_frame.f_code.co_filename
            if fn.endswith(TEMPLATE_SUFFIX):
                filename, lineno = fn, tb.tb_lineno
            tb = tb.tb_next
    where = f"{filename}:{lineno}" if filename and lineno else (filename or "template")
    kind = "template syntax error" if isinstance(e, jinja2.TemplateSyntaxError) else "template error"
    message = str(e).splitlines()[0] if str(e) else type(e).__name__
    return InputError(f"{where}: {kind}: {message}")


def render(spec: JobSpec, template_dirs: Sequence[str | os.PathLike] = (), *,
           spec_file: Optional[str] = None) -> str:
    """The sbatch script for ``spec`` (pure: reads templates, writes nothing).

    A supervised job's script ends with ``exec clusterops supervise``: with ``spec_file``
    (the caller writes :func:`supervise_spec_text` there, see :func:`spec_file_for`) it
    names that file; without, the spec rides on the line as ``--spec-json``, which is
    refused (InputError naming ``supervise``) when it would be too large to exec.
    """
    import jinja2

    if spec.supervise is not None and spec_file is None:
        problem = _inline_spec_problem(spec)
        if problem:
            raise InputError(f"{spec.source or 'spec'}: supervise: {problem}")

    env = _environment(template_dirs)
    name = spec.launcher + TEMPLATE_SUFFIX
    search = [d for d, _ in template_search_path(template_dirs)]
    try:
        template = env.get_template(name)
    except jinja2.TemplateNotFound as e:
        if e.name != name:
            raise _template_error(e, search) from None
        known = sorted(t["name"] for t in list_templates(template_dirs) if t["launcher"])
        where = spec.source or "spec"
        raise InputError(f"{where}: launcher: unknown launcher {spec.launcher!r} "
                         f"(one of {', '.join(known)}){schema.suggest(spec.launcher, known)}") from None
    except jinja2.TemplateError as e:
        raise _template_error(e, search) from None
    try:
        text = template.render(render_context(spec, spec_file))
    except (jinja2.TemplateError, ValueError, TypeError) as e:
        raise _template_error(e, search) from None
    if not text.startswith("#!"):
        raise InputError(f"{template.filename}: rendered script does not start with #!")
    return text

