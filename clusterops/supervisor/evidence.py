"""What a failed step's own output says about each task: its error line and any hardware sign (pure).

The training step runs under ``srun --label``, so every line a task writes to stdout or
stderr reaches the step log as ``TASK: text`` (srun pads the number when there are ten or
more tasks: `` 3: text``); srun's and slurmstepd's own lines carry no such label and are
left to :func:`clusterops.slurm.parse.parse_srun_failures`. :func:`read_task_output` turns
the log's text into one :class:`TaskOutput` per task that wrote something telling:

- ``error``: the last line of that task's last Python traceback (``KeyError: 'state'``),
  or the C++ runtime's "terminate called ..." if the task aborted itself after it: the
  program said why it stopped, so its exit is the program's, not the node's;
- ``sign``: the first line that matches :data:`HARDWARE_SIGNS` (a CUDA/NCCL/GPU error in
  the task's own words), with the sign's name: evidence that may point at the node.

The supervisor's state machine decides with these (``StepExited.task_output``); nothing
here knows about nodes, blame or policy.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

__all__ = ["HARDWARE_SIGNS", "NOT_HARDWARE", "SELF_ABORT", "WRAPPER_ERRORS", "TaskOutput", "read_task_output", "sign_of",
           "MAX_ERROR_CHARS"]

#: Text in a task's output that points at its node's hardware or driver, by name. Small on
#: purpose: each entry is something a healthy node does not print for a program's bug.
HARDWARE_SIGNS: Tuple[Tuple[str, "re.Pattern[str]"], ...] = (
    ("cuda_error", re.compile(r"\bCUDA error\b|\bcudaError[A-Z]\w*", re.I)),
    ("nccl_error", re.compile(r"\bNCCL error\b|\bnccl(?:System|Internal|Unhandled\w*)Error\b", re.I)),
    ("xid", re.compile(r"\bXid\b")),
    ("ecc_error", re.compile(r"\buncorrectable ECC\b|\bECC error", re.I)),
    ("illegal_memory_access", re.compile(r"\billegal memory access\b", re.I)),
    ("gpu_lost", re.compile(r"\bfallen off the bus\b|\bGPU is lost\b", re.I)),
    ("nvlink_error", re.compile(r"\bNVLink error\b", re.I)),
)

#: CUDA's wording for errors that are the program's own (too big a batch, an index out of
#: range in a kernel): they read as "CUDA error: ..." but say nothing against the node.
NOT_HARDWARE = re.compile(r"out of memory|device-side assert", re.I)

#: Exceptions a launcher raises *about* its child (torchrun's agent): the child's own
#: traceback, printed before it, is the one that says why.
WRAPPER_ERRORS = re.compile(r"(?:^|\.)ChildFailedError\b")

#: What the C++ runtime prints as it aborts the process (std::terminate: an exception nobody
#: caught, a joinable std::thread destroyed, a noexcept function that threw); the line
#: after, ``what():  ...``, says which exception. The process's own last word: a program
#: error, whatever signal follows. (Python's faulthandler lines are not in it: it prints
#: "Fatal Python error: Aborted" for a SIGABRT sent from outside too.)
SELF_ABORT = re.compile(r"^terminate called (?:without an active exception|after throwing an instance of \S.*|recursively)")
_WHAT = re.compile(r"^\s*what\(\):\s*(.*)$")

MAX_ERROR_CHARS = 200

# "3: text" or " 3: text" (srun --label); group 2 keeps the text's own indentation.
_LABELLED = re.compile(r"^\s*(\d+): ?(.*)$")
# torch.distributed prefixes what a rank with a process group writes to stderr through its
# exception hook and logging with "[rank3]:" (so a traceback reads "3: [rank3]:   File ...").
_TORCH_RANK = re.compile(r"^\[rank\d+\]: ?")
_TRACEBACK_HEAD = "Traceback (most recent call last):"


@dataclass(frozen=True)
class TaskOutput:
    """What one task's output says: the last line of its last traceback, and the first
    hardware sign (name, line) it printed; either may be missing."""

    error: Optional[str] = None
    sign: Optional[Tuple[str, str]] = None


def sign_of(line: str) -> Optional[str]:
    """The name of the first :data:`HARDWARE_SIGNS` entry ``line`` matches (None: none, or a
    CUDA error that is the program's own, see :data:`NOT_HARDWARE`)."""
    if NOT_HARDWARE.search(line):
        return None
    for name, pattern in HARDWARE_SIGNS:
        if pattern.search(line):
            return name
    return None


def _clip(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= MAX_ERROR_CHARS else text[:MAX_ERROR_CHARS - 3] + "..."


def read_task_output(text: str) -> Dict[int, TaskOutput]:
    """task -> :class:`TaskOutput` for every task whose labelled lines in ``text`` hold a
    traceback, a C++ abort (:data:`SELF_ABORT`, with its ``what()``) or a hardware sign
    (tasks with none are left out). The later of a traceback and an abort is the error."""
    in_traceback: Dict[int, bool] = {}
    aborting: Dict[int, bool] = {}      # the last line was a SELF_ABORT: a what() may follow
    errors: Dict[int, str] = {}
    signs: Dict[int, Tuple[str, str]] = {}
    for line in text.splitlines():
        m = _LABELLED.match(line)
        if m is None:
            continue
        task, body = int(m.group(1)), _TORCH_RANK.sub("", m.group(2).rstrip(), count=1)
        if task not in signs:
            name = sign_of(body)
            if name is not None:
                signs[task] = (name, _clip(body))
        if aborting.pop(task, False):
            w = _WHAT.match(body)
            if w is not None:
                errors[task] = _clip(f"{errors[task]}: {w.group(1)}")
                continue
        if SELF_ABORT.match(body.strip()):
            errors[task] = _clip(body)
            aborting[task] = True
            in_traceback[task] = False
            continue
        if body.lstrip().startswith(_TRACEBACK_HEAD):
            # A chained exception ("During handling of the above exception...") starts a
            # new traceback: the last one is the error the task died of.
            in_traceback[task] = True
            continue
        if not in_traceback.get(task) or not body.strip():
            continue
        if body[:1].isspace() or body.startswith("^"):
            continue          # a frame ("  File ...", its source line, 3.11's carets)
        # The first unindented line after the frames: "ExceptionType: message".
        in_traceback[task] = False
        if not WRAPPER_ERRORS.search(body.split(":", 1)[0]) or task not in errors:
            errors[task] = _clip(body)
    return {t: TaskOutput(errors.get(t), signs.get(t)) for t in sorted(set(errors) | set(signs))}


def first_error(outputs: Mapping[int, TaskOutput], tasks) -> Optional[Tuple[int, str]]:
    """(task, error line) of the first of ``tasks`` (in their order) that printed a traceback."""
    for t in tasks:
        out = outputs.get(t)
        if out is not None and out.error:
            return t, out.error
    return None
