"""Who may do what in Slurm: the caller's privilege level, asked once, before acting.

slurmctld (22.05 to 25.11, ``src/slurmctld/proc_req.c``) knows four levels:

- **user**: submits, queries, and requeues/holds/cancels/signals *its own* jobs;
- **operator** (``AdminLevel=Operator`` in the accounting database): also reservations and
  other users' jobs (``validate_operator``);
- **admin** (``AdminLevel=Administrator``, root, or the SlurmUser): also node updates --
  drain and resume are ``_slurm_rpc_update_node``, which asks ``validate_super_user``;
- **SlurmUser** (and root): runs the daemons; the only level the accounting database
  cannot grant.

How the caller's level is found, cheaply and without guessing: root and the
``SlurmUser`` named by ``scontrol show config`` are admins by definition. Anyone else
can only be an operator or admin through the accounting database, so with
``AccountingStorageType=accounting_storage/none`` (the dev cluster) they are plain users,
and with slurmdbd ``sacctmgr show user NAME format=AdminLevel`` says. When that cannot be
asked (sacctmgr missing or failing), the level is ``None``: unknown, and callers let Slurm
decide (and report its refusal) rather than refuse a possibly legitimate operator.

``parse_config``, ``parse_admin_level`` and ``level_for`` are pure; ``caller_level`` asks a
``Slurm`` client; ``require`` turns a missing privilege into one ``PrivilegeError`` line
(exit code 2: nothing was run).
"""

from __future__ import annotations

import enum
import pwd
import re
from typing import Dict, Optional, Tuple

from clusterops.errors import EXIT_USAGE, ClusteropsError


class Level(enum.IntEnum):
    USER = 0
    OPERATOR = 1
    ADMIN = 2
    SLURM_USER = 3

    @property
    def word(self) -> str:
        return {Level.USER: "user", Level.OPERATOR: "operator", Level.ADMIN: "admin",
                Level.SLURM_USER: "SlurmUser"}[self]


class PrivilegeError(ClusteropsError):
    """The caller lacks the Slurm privilege a command needs (exit 2, nothing was run)."""

    exit_code = EXIT_USAGE


# What Slurm says when a non-admin updates a node: 22.05 "slurm_update error: Invalid user
# id" (ESLURM_USER_ID_MISSING); later versions "Access/permission denied".
_REFUSED = re.compile(r"invalid user id|access/permission denied|permission denied|not authorized",
                      re.IGNORECASE)


def is_refusal(text: str) -> bool:
    """True when Slurm's error text says the caller lacks the privilege."""
    return bool(_REFUSED.search(text or ""))


def parse_config(text: str) -> Dict[str, str]:
    """``scontrol show config`` -> {key: value} (lines ``Key = value``)."""
    out: Dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out.setdefault(key.strip(), value.strip())
    return out


def slurm_user(config: Dict[str, str]) -> Tuple[str, Optional[int]]:
    """``SlurmUser = slurm(64030)`` -> ("slurm", 64030); the uid is None when not printed."""
    raw = config.get("SlurmUser", "")
    m = re.fullmatch(r"(\S*?)\((\d+)\)", raw)
    if m:
        return m.group(1), int(m.group(2))
    return raw, None


def parse_admin_level(text: str) -> Level:
    """``sacctmgr -nP show user NAME format=AdminLevel`` -> a level (nothing printed: a user
    the database does not know, so a plain user)."""
    words = [w.strip().lower() for w in text.splitlines() if w.strip()]
    if not words:
        return Level.USER
    return {"administrator": Level.ADMIN, "operator": Level.OPERATOR}.get(words[0], Level.USER)


def uses_slurmdbd(config: Dict[str, str]) -> bool:
    return config.get("AccountingStorageType", "").strip() == "accounting_storage/slurmdbd"


def level_for(uid: int, config: Dict[str, str], admin_level: Optional[Level]) -> Optional[Level]:
    """The caller's level (pure). ``admin_level`` is the database's answer (None: not asked
    or no answer); the result is None only when the database was needed and gave none."""
    name, slurm_uid = slurm_user(config)
    if uid == 0 or (slurm_uid is not None and uid == slurm_uid):
        return Level.SLURM_USER
    if not uses_slurmdbd(config):
        return Level.USER      # no database: nobody else can be granted a level
    return admin_level


def caller(slurm) -> str:
    """The user ``slurm``'s commands run as: its runner's ``as_user``, else this process's."""
    from clusterops.runner import current_user

    return getattr(getattr(slurm, "runner", None), "as_user", None) or current_user()


def caller_level(slurm) -> Optional[Level]:
    """The level of the user ``slurm``'s commands run as (its runner's ``as_user``, else this
    process's user). Raises what the client raises when Slurm cannot be asked at all."""
    user = caller(slurm)
    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        uid = int(user) if user.isdigit() else -1
    if uid == 0:
        return Level.SLURM_USER   # root is every level; no need to ask a controller that may be down
    config = parse_config(slurm.show_config())
    admin: Optional[Level] = None
    if uses_slurmdbd(config):
        try:
            admin = parse_admin_level(slurm.admin_level_text(user))
        except ClusteropsError:
            admin = None       # sacctmgr missing or refusing: unknown, Slurm decides later
    return level_for(uid, config, admin)


def require(slurm, needed: Level, what: str, why: str) -> Optional[Level]:
    """Raise ``PrivilegeError`` (one line) unless the caller has ``needed`` or more.
    An unknown level passes (Slurm itself refuses later, and the caller reports that)."""
    level = caller_level(slurm)
    if level is not None and level < needed:
        raise PrivilegeError(
            f"{what}: user {caller(slurm)} is a Slurm {level.word}, and {why} needs a Slurm "
            f"{needed.word} (root, the SlurmUser, or AdminLevel="
            f"{'Administrator' if needed >= Level.ADMIN else 'Operator'} in sacctmgr); nothing was run")
    return level
