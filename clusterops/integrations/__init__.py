"""Self-healing for training frameworks: one module per framework, imported on demand.

``clusterops.integrations.lightning`` (extra ``clusterops[lightning]``) holds a
Lightning callback, ``clusterops.integrations.transformers`` (extra ``clusterops[hf]``)
a Hugging Face ``TrainerCallback``. Each module imports its framework itself; this package imports
nothing, so ``import clusterops`` and the CLI never load a framework. The shared
piece, :func:`resume_dir`, uses only the SDK's environment contract.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)


def resume_dir(root: Optional[os.PathLike] = None, *, deep: bool = True) -> Optional[Path]:
    """The committed checkpoint directory to resume from, or None.

    the resume variable (``protocol.ENV_RESUME_FROM``) when it verifies (the supervisor chose and verified it),
    else the newest good one under the checkpoint root (``root`` or
    the checkpoint root (``protocol.ENV_CKPT_DIR``)); bad ones are skipped and logged.
    """
    from clusterops import checkpoint as ck
    from clusterops import protocol

    explicit = os.environ.get(protocol.ENV_RESUME_FROM)
    if explicit:
        info = ck.verify(explicit, deep=deep)
        if info.ok:
            return Path(explicit)
        log.warning("%s=%s is not a good checkpoint (%s); looking for the newest good one",
                    protocol.ENV_RESUME_FROM, explicit, "; ".join(info.problems))
    r = root or os.environ.get(protocol.ENV_CKPT_DIR)
    if not r:
        return None
    found = ck.find_latest_good(r, deep=deep)
    for bad in found.skipped:
        log.warning("skipped bad checkpoint %s: %s", bad.path, "; ".join(bad.problems))
    return found.latest.path if found.latest else None
