"""The CLI reference: every click command's ``--help``, as one Markdown page.

The page is made from the click commands themselves (``clusterops.cli.cli`` and every
group under it), so it says what ``--help`` says and cannot drift from it. The docs site
builds it at build time (``mkdocs.yml`` names this file as a hook: ``on_files`` adds the
page ``cli.md``); ``python -m clusterops.cli.reference`` prints it.
"""

from __future__ import annotations

import html
import re
from typing import Iterator, List, Optional, Tuple

import click

PAGE = "cli.md"
WIDTH = 88   # the help text's width on the page


def walk(command: click.Command, name: str = "clusterops",
         parent: Optional[click.Context] = None) -> Iterator[Tuple[str, click.Context]]:
    """(command path, context) for ``command`` and every command under it, depth first,
    subcommands in the order ``--help`` lists them."""
    ctx = click.Context(command, info_name=name, parent=parent, terminal_width=WIDTH, max_content_width=WIDTH)
    yield ctx.command_path, ctx
    if isinstance(command, click.Group):
        for sub in command.list_commands(ctx):
            child = command.get_command(ctx, sub)
            if child is not None and not getattr(child, "hidden", False):
                yield from walk(child, sub, ctx)


def command_paths(root: Optional[click.Command] = None) -> List[str]:
    return [path for path, _ in walk(root or _root())]


def _root() -> click.Command:
    from clusterops.cli import cli
    return cli


def _anchor(path: str) -> str:
    """The heading's id as Markdown's table of contents makes it (lowercase, '-' for ' ')."""
    return path.lower().replace(" ", "-")


def _plain(text: str) -> str:
    """``text`` as literal Markdown: no markup, no HTML (a ``<prefix>`` stays visible)."""
    text = html.escape(text, quote=False)
    return re.sub(r"([\\`*_\[\]#])", r"\\\1", text)


def markdown(root: Optional[click.Command] = None) -> str:
    """The reference page: an index of the commands, then each command's ``--help``."""
    entries = list(walk(root or _root()))
    out = ["# CLI reference", "",
           "Every command's `--help`, generated from the click commands when the site is built",
           "(`clusterops/cli/reference.py`; `python -m clusterops.cli.reference` prints this page).",
           ""]
    for path, ctx in entries:
        depth = path.count(" ")
        short = _plain(ctx.command.get_short_help_str(limit=80))
        out.append(f"{'  ' * depth}- [`{path}`](#{_anchor(path)}){': ' + short if short else ''}")
    out.append("")
    for path, ctx in entries:
        out += [f"## {path}", "", "```text", ctx.command.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(out)


def on_files(files, config):
    """mkdocs hook: add the generated reference to the site's files as ``cli.md``."""
    from mkdocs.structure.files import File

    text = markdown()
    if hasattr(File, "generated"):   # mkdocs >= 1.6
        f = File.generated(config, PAGE, content=text)
    else:
        import os
        import tempfile
        tmp = tempfile.mkdtemp(prefix="clusterops-cliref-")
        with open(os.path.join(tmp, PAGE), "w", encoding="utf-8") as fh:
            fh.write(text)
        f = File(PAGE, tmp, config["site_dir"], config["use_directory_urls"])
    existing = files.get_file_from_path(PAGE)
    if existing is not None:
        files.remove(existing)
    files.append(f)
    return files


if __name__ == "__main__":
    click.echo(markdown(), nl=False)
