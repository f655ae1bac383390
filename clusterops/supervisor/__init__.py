"""The job supervisor: heals a multi-node training run inside its allocation.

- ``machine``: the pure state machine (events in, actions out, the clock passed in) and
  the ``Policy`` it decides by; re-exported here, so ``from clusterops import supervisor
  as sv; sv.Supervisor(...)`` is the way in.
- ``config``: a resolved job spec and the command's flags -> the ``RunConfig`` that ``run``
  takes (``clusterops supervise`` makes this one call before it runs).
- ``run``: the runtime plumbing that turns the machine's actions into srun steps,
  signals, drains and requeues (``clusterops supervise`` runs it).
- ``timeline``: the job's event log and its text/SVG/HTML views.
- ``evidence``: what a failed step's ranks said themselves: a traceback's last line, a
  CUDA/NCCL/GPU error sign (pure; the machine blames a node only on evidence).
- ``stacks``: Python stacks of hung ranks (run on each node as a step).
- ``flightrec``: a hang with a name: the rank that never entered the collective the others
  wait in, from the ranks' flight-recorder dumps (pure).
- ``ncclras``: NCCL's RAS report on a hang (the client protocol; the ranks missing or
  behind in this job's communicators).
- ``channel``: the supervisor's end of the heartbeat channel (a UDP receiver and the
  file fallback).
- ``stragglers``: the slow node of a running job from its heartbeats (pure).
- ``membership``: who trains in each generation of an in-process recovery (pure).
- ``rendezvous``: the rendezvous store (torch's ``TCPStore``) hosted for in-process recovery.
- ``stability``: loss spikes and non-finite values from the heartbeats, and what to do
  about them: record, stop, or roll back with a data skip and an LR factor (pure).
"""

from clusterops.supervisor.machine import *  # noqa: F401,F403
from clusterops.supervisor.machine import __all__  # noqa: F401
