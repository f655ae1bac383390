"""Shared option decorators and output helpers for the CLI modules."""

from __future__ import annotations

import sys
from typing import Any

import click

json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")


def echo_json(data: Any) -> None:
    """Strict JSON (no NaN/Infinity: they become null), for every command's --json."""
    from clusterops.jsonout import dumps

    click.echo(dumps(data))


def slurm_client(**overrides):
    """A Slurm client for the current environment (SLURM_CONF, or the default dev cluster;
    site settings from CLUSTEROPS_SLURM_*), through ``clusterops.slurm.factory.connect``."""
    from clusterops.slurm.factory import connect

    return connect(**overrides)


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error and exit with code."""
    click.echo(f"Error: {message}", err=True)
    sys.exit(code)
