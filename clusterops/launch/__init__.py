"""Launch: a YAML job spec -> a validated JobSpec -> a rendered sbatch script -> a submitted job.

Three steps, kept apart (render first, submit second):

* ``spec``: ``load_spec(path, overrides)`` reads the YAML, validates every key by the
  table ``clusterops.schema.JOB_SPEC`` and returns a :class:`JobSpec` (one-line errors
  naming the file, line and key; exit 2).
* ``templates``: which launcher templates there are and where each comes from.
* ``render``: ``render(spec, template_dirs)`` is pure: spec in, script text out, through
  Jinja2 templates with a quoting filter on every value that reaches the shell.
* ``submit``: ``submit(spec, slurm)`` renders, writes the script (and a supervised job's
  spec file) next to the logs and calls ``Slurm.submit``; the package's only side effect.

This module re-exports the public names the CLI, the supervisor and the tests use.
"""

from clusterops.launch.render import (SPEC_FILE_SUFFIX, one_line, render, render_context, sbatch_quote,
                                      shell_quote, slurm_filename, spec_file_for, supervise_spec_text)
from clusterops.launch.spec import (DEFAULT_SIGNAL_LEAD_S, LAUNCHERS, MAX_ARG_STRLEN, REQUIRED_KEYS, JobSpec,
                                    apply_overrides, arg_max_bytes, exec_limit_problem, load_spec,
                                    parse_slurm_time, parse_spec_text)
from clusterops.launch.submit import Submitted, script_filename, submit, write_job_files
from clusterops.launch.templates import (BASE_TEMPLATE, TEMPLATE_SUFFIX, TEMPLATES_ENV, builtin_template_dir,
                                         list_templates, template_search_path)

__all__ = [
    "BASE_TEMPLATE", "DEFAULT_SIGNAL_LEAD_S", "JobSpec", "LAUNCHERS", "MAX_ARG_STRLEN", "REQUIRED_KEYS",
    "SPEC_FILE_SUFFIX", "Submitted", "TEMPLATES_ENV", "TEMPLATE_SUFFIX", "apply_overrides", "arg_max_bytes",
    "builtin_template_dir", "exec_limit_problem", "list_templates", "load_spec", "one_line",
    "parse_slurm_time", "parse_spec_text", "render", "render_context", "sbatch_quote", "script_filename",
    "shell_quote", "slurm_filename", "spec_file_for", "submit", "supervise_spec_text", "template_search_path",
    "write_job_files",
]
