"""``clusterops ckpt``: list, find, verify, prune and shrink checkpoints.

A checkpoint is a ``step_<N>`` directory with a valid manifest under a checkpoint
root (see docs/checkpoint.md). These commands never import torch except ``shrink``.
"""

from __future__ import annotations

import os
from pathlib import Path

import click

from clusterops.cli.common import echo_json, json_option
from clusterops.exitcodes import Ckpt, epilog
from clusterops.textsafe import terminal


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return str(n)


def _root_arg(root: str) -> Path:
    from clusterops.errors import InputError

    if "\x00" in root:
        raise InputError(f"{root!r}: not a valid path")
    p = Path(root)
    if not p.exists():
        raise InputError(f"{root}: checkpoint root does not exist")
    if not p.is_dir():
        raise InputError(f"{root}: checkpoint root is not a directory")
    return p


def _flock_warning(root) -> None:
    """One stderr line when the root's filesystem has node-local flock (docs/checkpoint.md)."""
    from clusterops.checkpoint.locks import node_local_flock

    why = node_local_flock(root)
    if why:
        click.echo(f"warning: {why}", err=True)


@click.group(epilog=epilog(Ckpt))
def ckpt() -> None:
    """List, verify, prune and shrink checkpoints.

    Malformed step directories are reported as BAD with the reason and skipped;
    no file in a checkpoint is ever loaded with code execution unless
    `shrink --unsafe-load` is given.
    """


@ckpt.command("list")
@click.argument("root")
@click.option("--deep", is_flag=True, help="Also check every file's hash (reads all data).")
@json_option
def list_cmd(root: str, deep: bool, as_json: bool) -> None:
    """List the committed checkpoints under ROOT, oldest first, with their status."""
    from clusterops import checkpoint as ck

    infos = ck.list_checkpoints(_root_arg(root), deep=deep)
    _flock_warning(root)
    temps = ck.dead_temporaries(root)
    held = ck.holds(root)
    if as_json:
        echo_json({"root": str(root), "checkpoints": [dict(i.to_dict(), held=held.get(i.path.name)) for i in infos],
                   "dead_temporaries": [str(p) for p in temps]})
        return
    if not infos:
        click.echo(f"no checkpoints under {root}")
    for i in infos:
        status = "ok" if i.ok else "BAD"
        extra = "" if i.ok else "  " + "; ".join(i.problems)
        ws = (i.manifest or {}).get("world_size", "-")
        why = f"  held: {held[i.path.name]}" if i.path.name in held else ""
        click.echo(terminal(f"{i.path.name}  step={i.step}  {status}  ranks={ws}  {_human(i.size_bytes)}{extra}{why}"))
    for p in temps:
        click.echo(f"{terminal(p.name)}  (temporary of a dead save; `ckpt prune` removes it)")


@ckpt.command("latest")
@click.argument("root")
@click.option("--deep", is_flag=True, help="Check hashes too (reads all data of the candidates).")
@json_option
def latest_cmd(root: str, deep: bool, as_json: bool) -> int:
    """Print the path of the newest good checkpoint under ROOT (exit 1 when there is none).

    Newer directories that fail the check are skipped and reported on stderr.
    """
    from clusterops import checkpoint as ck

    found = ck.find_latest_good(_root_arg(root), deep=deep)
    _flock_warning(root)
    for bad in found.skipped:
        click.echo(terminal(f"skipped {bad.path}: {'; '.join(bad.problems)}"), err=True)
    if as_json:
        echo_json({"latest": found.latest.to_dict() if found.latest else None,
                   "skipped": [b.to_dict() for b in found.skipped]})
    elif found.latest is not None:
        click.echo(str(found.latest.path))
    else:
        click.echo(f"no good checkpoint under {root}", err=True)
    return 0 if found.latest is not None else 1


@ckpt.command("verify")
@click.argument("path")
@click.option("--deep", is_flag=True, help="Recompute every file's hash against the manifest.")
@json_option
def verify_cmd(path: str, deep: bool, as_json: bool) -> int:
    """Check one checkpoint directory: manifest, file sizes, and hashes with --deep.

    Exit 0 when good, 1 when bad (each problem printed).
    """
    from clusterops import checkpoint as ck
    from clusterops.errors import InputError

    if "\x00" in path:
        raise InputError(f"{path!r}: not a valid path")
    info = ck.verify(path, deep=deep)
    if as_json:
        echo_json(info.to_dict())
    elif info.ok:
        m = info.manifest or {}
        click.echo(f"{path}: ok (step {info.step}, {len(m.get('files', {}))} files, {_human(info.size_bytes)}"
                   f"{', hashes checked' if deep else ', sizes checked; --deep checks hashes'})")
    else:
        click.echo(f"{path}: BAD", err=True)
        for p in info.problems:
            click.echo(f"  {terminal(p)}", err=True)
    return 0 if info.ok else 1


@ckpt.command("release")
@click.argument("root")
@click.argument("steps", nargs=-1, type=click.IntRange(min=0))
@click.option("--all", "release_all", is_flag=True, help="Release every hold under ROOT.")
@json_option
def release_cmd(root: str, steps, release_all: bool, as_json: bool) -> None:
    """Release the holds on checkpoints STEPS under ROOT (or --all), so that `ckpt prune` may
    remove them again.

    The stability guard holds the newest checkpoint before a loss spike or NaN (and a
    rollback's target) and never lifts a hold itself. A step that is not held is an error
    and nothing is released.
    """
    from clusterops import checkpoint as ck
    from clusterops.errors import InputError

    if bool(steps) == release_all:
        raise InputError("give the STEPS to release or --all (not both)")
    try:
        gone = ck.release(_root_arg(root), None if release_all else list(steps))
    except OSError as e:
        raise ck.CheckpointError(f"{root}: holds not released: {e}") from None
    if as_json:
        echo_json({"root": str(root), "released": gone})
        return
    if not gone:
        click.echo(f"no holds under {root}")
    for name, why in sorted(gone.items()):
        click.echo(terminal(f"released {name} (held: {why})"))


@ckpt.command("prune")
@click.argument("root")
@click.option("--keep-last", type=click.IntRange(min=1), required=True, help="Keep the newest N checkpoints.")
@click.option("--keep-every", type=click.IntRange(min=1), default=None,
              help="Also keep every checkpoint whose step is a multiple of K.")
@click.option("--dry-run", is_flag=True, help="Print what would be removed; change nothing.")
@json_option
def prune_cmd(root: str, keep_last: int, keep_every, dry_run: bool, as_json: bool) -> None:
    """Remove old checkpoints and temporaries of dead saves under ROOT.

    The latest good checkpoint, decided with every hash checked, is always kept,
    even when newer ones are broken; when none passes the hash check, no checkpoint
    is removed. Temporaries of live writers (their lock is held) are left alone;
    the only copy of a step left under a hidden name by a dead writer is put back.
    """
    from clusterops import checkpoint as ck

    _flock_warning(_root_arg(root))
    plan = ck.prune(root, keep_last, keep_every, dry_run=dry_run)
    if as_json:
        echo_json(dict(plan.to_dict(), dry_run=dry_run))
        return
    verb = "would remove" if dry_run else "removed"
    for a, b in plan.restore:
        click.echo(terminal(f"{'would restore' if dry_run else 'restored'} {a} as {b} "
                            "(left by a writer that died replacing it)"))
    if plan.note:
        click.echo(plan.note)
    for p in plan.remove:
        click.echo(f"{verb} {terminal(p)}")
    for p in plan.changed:
        click.echo(f"kept {terminal(p)}: it changed since prune judged it (re-saved meanwhile)")
    for p in plan.temporaries:
        click.echo(f"{verb} {terminal(p)} (temporary of a dead save)")
    click.echo(f"kept {len(plan.keep)}; latest good: {plan.latest_good or 'none'}")


@ckpt.command("shrink")
@click.argument("path")
@click.option("--unsafe-load", is_flag=True,
              help="Allow files that need pickled code to load (runs code from the checkpoint: "
                   "only for checkpoints you trust). Default: weights_only loading, such files refused.")
@json_option
def shrink_cmd(path: str, unsafe_load: bool, as_json: bool) -> None:
    """Re-save tensors whose storage is larger than their view (recommits PATH).

    Exit 1 when PATH is not a good checkpoint or a file needs pickled code to load
    (refused unless --unsafe-load).
    """
    from clusterops import checkpoint as ck
    from clusterops.errors import InputError

    if "\x00" in path or not os.path.isdir(path) or os.path.islink(path):
        raise InputError(f"{path!r}: not a checkpoint directory")
    _flock_warning(path)
    rep = ck.shrink(path, unsafe_load=unsafe_load)
    if as_json:
        echo_json(rep.to_dict())
        return
    saved = rep.bytes_before - rep.bytes_after
    click.echo(f"{path}: {_human(rep.bytes_before)} -> {_human(rep.bytes_after)} "
               f"({rep.tensors_shrunk} tensors shrunk, {_human(max(saved, 0))} saved)")
