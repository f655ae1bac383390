"""The training SDK: what a training script imports.

    from clusterops import sdk
    dist = sdk.init_distributed()          # torchrun or srun-native ranks; gloo/nccl
    ckpt = sdk.resume()                    # None, or the state to continue from
                                           # (ckpt.hint: a stability rollback's skip/LR factor)
    ...
    for step in range(start, steps):
        with sdk.compute():                # optional: this rank's own work, for straggler
            loss = train_one_step()        # detection (leave the collectives outside)
        sync_gradients()
        sdk.heartbeat(step + 1, loss=loss)  # cheap: at most ~1 write per second
        if (step + 1) % every == 0:
            sdk.save(state, step + 1, async_=True)
        if sdk.should_stop():              # all ranks agree (one small collective)
            path = sdk.save(state, step + 1)
            sdk.mark_stopped(step + 1, path); break
    sdk.wait()

The contract with ``clusterops supervise`` (environment variables, heartbeat files,
the stop file, the stopped marker) is written down in :mod:`clusterops.protocol`; all
of it is optional. SIGTERM, SIGUSR2 and the launcher's lead-time SIGUSR1 request a stop
like the stop file, supervised or not (``STOP_SIGNALS``). A script that honours a stop
before its end calls ``sdk.mark_stopped(step, path)`` (rank 0 writes the marker), so the
supervisor reads its clean exit as "stopped", not "finished".

On disk (see clusterops.checkpoint): the state goes through
:mod:`clusterops.checkpoint.codec`, so ``resume().state`` is what ``save`` was given
(structure, container and key types, empty containers, plain values, tensors bit for
bit); what it cannot keep is refused by ``save`` before anything is written. One
process writes the state's skeleton (``state.skeleton.json``: structure and non-tensor
values), its tensors (``state.pt``, one torch.save of a flat dict) and ``rank_0.pt`` (RNG
states and per-rank state); many ranks write the tensors with torch.distributed.checkpoint
into ``dcp/`` (each rank its shard) and rank 0 the skeleton, plus one ``rank_<r>.pt``
each, and rank 0 writes the manifest and commits after all ranks are done. torch is
imported on first use, not at import.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from clusterops import checkpoint as ck
from clusterops import protocol
from clusterops.checkpoint import codec
from clusterops.errors import ClusteropsError

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
STOP_FILE_POLL_S = 0.25
STATE_FILE = "state.pt"
# Signals that ask for a stop: SIGTERM (preemption, scancel), SIGUSR2 (the supervisor)
# and SIGUSR1, the lead-time signal a clusterops batch script forwards to the ranks
# before the time limit (`signal_lead_s`, `#SBATCH --signal=B:USR1@N`). Without a
# handler SIGUSR1's default action kills the process, so an unsupervised `srun` or
# `torchrun` job would die instead of saving.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1)
DCP_DIR = "dcp"


def rank_file(rank: int) -> str:
    return f"rank_{rank}.pt"


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass
class Resumed:
    """What resume() returns: the state to continue from."""

    step: int
    state: Any
    rank_state: Any
    path: Path
    manifest: dict
    rng_restored: bool
    #: What the supervisor decided for this resume (a stability rollback: skip
    #: ``hint.skip_batches`` batches from the restored data position, multiply the learning
    #: rate by ``hint.lr_factor``); None for an ordinary resume.
    hint: Optional[protocol.ResumeHint] = None


class _Runtime:
    def __init__(self):
        self.dist = DistInfo()
        self.initialized = False
        self.ckpt_group = None  # process group used by checkpoint collectives (async-safe)
        self.stop_requested = False
        self.stop_agreed = False
        self.stop_reason = ""
        self.stop_file_checked_at = 0.0
        self.stopped_marked = False
        self.hb_at = -1e18
        self.hb_sender = None   # clusterops.heartbeat.NodeSender, made on the first beat
        self.watchdog = None    # clusterops.watchdog.Watchdog, with the sender
        self.watchdog_at_exit = False
        self.hb_refused = None  # (addr, dir) whose node channel was refused: per-rank files instead
        self.busy_s = 0.0       # time in compute() blocks since the last beat
        self.busy_known = False # the script uses compute() (else no busy time is reported)
        self.hb_paused = False  # a checkpoint save fell in the time since the last beat
        self.loss_sum, self.loss_n = 0.0, 0   # losses reported since the last beat (stability guard)
        self.loss_bad: Optional[float] = None # a non-finite one among them (it wins)
        self.gnorm_max: Optional[float] = None
        self.inflight: Optional[_AsyncSave] = None
        self.last_async_step: Optional[int] = None
        self.atexit_registered = False
        self.snapshot_pool: dict = {}  # buffers of the last async snapshot, reused by the next
        self.signals_installed = False
        self.prev_handlers = {}
        self.step_hook = None   # clusterops.recover: told of every heartbeat's step
        self.resume_hook = None  # clusterops.recover: told of every resume (what it loaded, seconds)
        self.flip_done = False   # the replica test hook flipped its bit (once per process)
        self.replicas_bad_reported = False   # a disagreement was reported: later checks keep it
        self.replicas_last_agree: Optional[int] = None   # this process's last check that agreed
        self.nonfinite_reported = False   # this rank's first non-finite signal was reported
        self.replay_order = None          # protocol.ReplayOrder of a replay attempt (parsed once)
        self.replay_parsed = False
        self.replay_losses: dict = {}     # step -> loss, of the replayed steps
        self.replay_first_nf: Optional[int] = None


_rt = _Runtime()


def _report_uncaught(exc_type, exc, tb) -> None:
    """sys.excepthook under a supervisor: the last line of the traceback this process dies
    of, into the heartbeat directory (``protocol.write_error``), then the previous hook. The
    supervisor reads it as the rank's own word (a program error, not the node's), also when
    srun dropped the task's last stderr. Never raises."""
    try:
        import traceback

        d = os.environ.get(protocol.ENV_HEARTBEAT_DIR)
        if d and not issubclass(exc_type, (KeyboardInterrupt, SystemExit)):
            last = "".join(traceback.format_exception_only(exc_type, exc)).strip().splitlines()
            if last:
                protocol.write_error(d, _rank(), last[-1])
    except Exception:  # noqa: BLE001 - the original error must still be printed
        pass
    _report_uncaught.previous(exc_type, exc, tb)


def _install_error_report() -> None:
    """Wrap the current sys.excepthook once (a supervised run: the heartbeat directory is set)."""
    if os.environ.get(protocol.ENV_HEARTBEAT_DIR) and sys.excepthook is not _report_uncaught \
            and not hasattr(_report_uncaught, "previous"):
        _report_uncaught.previous = sys.excepthook
        sys.excepthook = _report_uncaught


_install_error_report()


def _reset() -> None:
    """Forget all SDK state and restore signal handlers (tests, or a second run in-process)."""
    global _rt
    if _rt.watchdog is not None:
        _rt.watchdog.close()
    for sig, h in _rt.prev_handlers.items():
        signal.signal(sig, h)
    _rt = _Runtime()


def _env_int(*names: str, default: int) -> int:
    for n in names:
        v = os.environ.get(n)
        if v not in (None, ""):
            return int(v)
    return default


def _rank() -> int:
    """This process's rank without any collective (before init: from the environment)."""
    return _rt.dist.rank if _rt.initialized else _env_int("RANK", "SLURM_PROCID", default=0)


def restart_count() -> int:
    return _env_int(protocol.ENV_RESTART_COUNT, default=0)


def ckpt_root(root: Optional[os.PathLike] = None) -> Path:
    r = root or os.environ.get(protocol.ENV_CKPT_DIR)
    if not r:
        raise ClusteropsError(f"no checkpoint root: pass root= or set {protocol.ENV_CKPT_DIR}")
    return Path(r)


def _ensure_runtime() -> DistInfo:
    """Adopt a process group the script initialized itself (without init_distributed)."""
    if _rt.initialized:
        return _rt.dist
    dist_mod = sys.modules.get("torch.distributed")
    if dist_mod is not None and dist_mod.is_available() and dist_mod.is_initialized():
        world = dist_mod.get_world_size()
        _rt.dist = DistInfo(rank=dist_mod.get_rank(), world_size=world,
                            local_rank=_env_int("LOCAL_RANK", "SLURM_LOCALID", default=0),
                            backend=str(dist_mod.get_backend()))
        if world > 1:
            _rt.ckpt_group = dist_mod.new_group(backend="gloo")  # collective: every rank gets here together
        _rt.initialized = True
    return _rt.dist


# ----------------------------------------------------------------------------- init


def _keep_group_collectable() -> None:
    """Import torch.distributed.nn.functional before any process group exists, so that
    ``destroy_process_group()`` really frees the group.

    That module's collectives take ``group=group.WORLD`` as a default argument, read once,
    when it is first imported -- which torch._dynamo does, and the first optimizer or DDP
    model a script builds imports torch._dynamo. Imported after ``init_process_group()``,
    those defaults hold the default group for the rest of the process (measured, torch
    2.13): destroying the group leaves its gloo worker threads running into Python's
    shutdown, where one can abort the process (docs/supervisor.md, "A rank that aborts at
    exit"), and an in-process restart keeps the generation's group they caught, with its
    threads and sockets, after tearing it down. Imported first, the defaults are None.
    Once a group exists it is too late, and this does nothing.
    """
    import torch.distributed as dist

    if not dist.is_available() or dist.is_initialized():
        return
    try:
        import torch.distributed.nn.functional  # noqa: F401  (2 ms)
    except Exception as e:      # an exotic build without it: nothing to hold the group
        log.debug("torch.distributed.nn.functional: %s", e)


def init_distributed(backend: Optional[str] = None, *, timeout_s: float = 600.0,
                     install_signal_handlers: bool = True) -> DistInfo:
    """Join the process group from torchrun's or Slurm's environment.

    torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; srun-native ranks have SLURM_PROCID/
    SLURM_NTASKS/SLURM_LOCALID and the launcher exports MASTER_ADDR/MASTER_PORT.
    A world of one initializes nothing. Also installs the stop-request handlers
    (STOP_SIGNALS: SIGTERM, SIGUSR2, SIGUSR1) when called from the main thread.
    """
    if install_signal_handlers:
        install_stop_handlers()
    if _rt.initialized:
        return _rt.dist
    rank = _env_int("RANK", "SLURM_PROCID", default=0)
    world = _env_int("WORLD_SIZE", "SLURM_NTASKS", default=1)
    local = _env_int("LOCAL_RANK", "SLURM_LOCALID", default=0)
    info = DistInfo(rank=rank, world_size=world, local_rank=local)
    if world > 1:
        import datetime

        import torch
        import torch.distributed as dist

        for var in ("MASTER_ADDR", "MASTER_PORT"):
            if not os.environ.get(var):
                raise ClusteropsError(f"{var} is not set: the launcher must export it for {world} ranks")
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            _keep_group_collectable()
            dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        # Checkpoint collectives run on their own gloo group, so an async save's
        # background thread never interleaves with the training's collectives.
        _rt.ckpt_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        info.backend = backend
    _rt.dist = info
    _rt.initialized = True
    return info


def shutdown() -> None:
    """Wait for an in-flight save and leave the process group."""
    try:
        wait()
    finally:
        if _rt.dist.distributed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        _rt.initialized = False
        _rt.ckpt_group = None


def _adopt_group(rank: int, world: int, backend: str) -> None:
    """clusterops.recover formed a generation's default group: use it (and a gloo group of its
    own for the checkpoint collectives, as init_distributed makes)."""
    import torch.distributed as dist

    _rt.dist = DistInfo(rank=rank, world_size=world, local_rank=_env_int("LOCAL_RANK", "SLURM_LOCALID", default=0),
                        backend=backend)
    _rt.ckpt_group = dist.new_group(backend="gloo") if world > 1 else None
    _rt.initialized = True
    _rt.stop_agreed = False


def _drop_group() -> None:
    """clusterops.recover is about to destroy a broken generation's group: forget it (an async
    save that was in flight on it is abandoned; its temporary directory is never committed)."""
    _rt.inflight = None
    _rt.ckpt_group = None
    _rt.initialized = False


def _set_step_hook(fn) -> None:
    _rt.step_hook = fn


def _set_resume_hook(fn) -> None:
    """clusterops.recover (sharded mode): ``fn(resumed_or_None, seconds)`` after every resume()."""
    _rt.resume_hook = fn


# ----------------------------------------------------------------------------- stop requests


def _on_stop_signal(signum, frame) -> None:
    if _rt.stop_requested and signum == signal.SIGTERM:
        # A second SIGTERM: the caller means it. Die the default way.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    _rt.stop_requested = True
    _rt.stop_reason = _rt.stop_reason or signal.Signals(signum).name


def install_stop_handlers(*, force: bool = False) -> bool:
    """Make STOP_SIGNALS requests to stop (see should_stop); True when installed.

    Only the main thread can install handlers; from another thread this returns False
    (unless an earlier call installed them). Launchers that start with SIGUSR1 ignored
    (the torchrun, accelerate and deepspeed wrappers) pass that on to their workers;
    installing a handler here replaces the inherited SIG_IGN, so the worker hears it.
    ``force``: install them again, for a framework that replaced them since (Lightning
    registers its own SIGTERM handler when fit starts; clusterops.integrations).
    """
    if threading.current_thread() is not threading.main_thread():
        return _rt.signals_installed
    if _rt.signals_installed and not force:
        return True
    for sig in STOP_SIGNALS:
        prev = signal.signal(sig, _on_stop_signal)
        _rt.prev_handlers.setdefault(sig, prev)
    _rt.signals_installed = True
    global _exit_quiet_registered
    if not _exit_quiet_registered:
        _exit_quiet_registered = True
        atexit.register(_quiet_stop_signals_at_exit)
    return True


_exit_quiet_registered = False
# Stop requests that are moot once the process is exiting. Python puts every handler it set
# back to SIG_DFL late in its shutdown (after atexit), and USR1/USR2's default action kills:
# a stop that lands while a finished or stopped process tears down (torch's modules take a
# while) turned its clean exit into "User defined signal 2" (the supervisor's USR2 to the
# step reached the in-process standbys just as they left, Slurm 24.11). SIGTERM keeps its
# default there: it is also Slurm's way of ending a step that hangs.
_EXIT_IGNORED = (signal.SIGUSR1, signal.SIGUSR2)


def _quiet_stop_signals_at_exit() -> None:
    for sig in _EXIT_IGNORED:
        try:
            if signal.getsignal(sig) is _on_stop_signal:   # still ours (not reset, not replaced)
                signal.signal(sig, signal.SIG_IGN)
        except (ValueError, OSError):   # not the main thread / interpreter half gone
            pass


def request_stop(reason: str = "requested") -> None:
    _rt.stop_requested = True
    _rt.stop_reason = _rt.stop_reason or reason


def _local_stop() -> bool:
    if _rt.stop_requested:
        return True
    path = os.environ.get(protocol.ENV_STOP_FILE)
    if path:
        now = time.monotonic()
        if now - _rt.stop_file_checked_at >= STOP_FILE_POLL_S:
            _rt.stop_file_checked_at = now
            if protocol.stop_requested(path):
                _rt.stop_requested = True
                _rt.stop_reason = _rt.stop_reason or "stop file"
    return _rt.stop_requested


def should_stop() -> bool:
    """True once a stop was requested on any rank; all ranks return the same value.

    With many ranks this is a collective (one all-reduce of one number): every rank
    must call it at the same points of the loop.
    """
    if _rt.stop_agreed:
        return True
    _ensure_runtime()
    install_stop_handlers()
    local = _local_stop()
    if _rt.dist.distributed:
        import torch
        import torch.distributed as dist

        device = f"cuda:{_rt.dist.local_rank}" if _rt.dist.backend == "nccl" else "cpu"
        t = torch.tensor([1 if local else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        agreed = bool(t.item())
    else:
        agreed = local
    if agreed:
        _rt.stop_agreed = True
        if not _rt.stop_reason:
            _rt.stop_reason = "another rank"
    return agreed


def stop_reason() -> str:
    return _rt.stop_reason


def mark_stopped(step: int, path: Optional[os.PathLike] = None) -> bool:
    """Tell the supervisor this run stops on request before its end (all ranks may call it).

    Call it after the checkpoint that honours the stop (``path``, if any) committed and
    before exiting: rank 0 writes the protocol's stopped marker, so an exit 0 reads as
    "stopped" and the job is continued, not as "finished". Not for a run that reached its
    last step anyway. Once per process; never raises; True when written.
    """
    d = os.environ.get(protocol.ENV_HEARTBEAT_DIR)
    if not d or _rt.stopped_marked or _rank() != 0:
        return False
    _rt.stopped_marked = True
    try:
        protocol.write_stopped(d, step=step, path=path, reason=_rt.stop_reason or "requested")
    except OSError as e:
        # The supervisor falls back to the output line and the exit code.
        log.warning("stopped marker in %s not written: %s", d, e)
        return False
    return True


# ----------------------------------------------------------------------------- heartbeat


_compute_depth = threading.local()


class _Compute:
    """The context manager :func:`compute` returns (re-entrant: nested blocks of one thread
    count once)."""

    def __enter__(self):
        depth = getattr(_compute_depth, "n", 0)
        if depth == 0:
            self.t0 = time.monotonic()
        _compute_depth.n = depth + 1
        return self

    def __exit__(self, *exc):
        _compute_depth.n -= 1
        if _compute_depth.n == 0:
            add_busy(time.monotonic() - self.t0)
        return False


def compute() -> _Compute:
    """``with sdk.compute(): ...`` around this rank's own work in a step (forward,
    backward, optimizer step), leaving out the collectives where it waits for the others.

    Optional. The time inside is this rank's *busy* time; it goes to the supervisor with
    the heartbeat (mean per step) for straggler detection: in a synchronous job every
    rank's step takes as long as the slowest one's, but the slow rank is the one that
    waits least, so its busy time stands out. Costs two clock reads per block.
    """
    return _Compute()


def add_busy(seconds: float) -> None:
    """Count ``seconds`` of this rank's own work (what :func:`compute` does for a block),
    for a framework that measures its compute time itself."""
    _rt.busy_known = True
    _rt.busy_s += max(0.0, float(seconds))


def _take_signals(loss, grad_norm) -> None:
    """Add one step's loss and grad norm to the interval's figures (mean loss, largest grad
    norm; a value that is not finite wins, and stays until the beat that carries it)."""
    if loss is not None:
        v = float(loss)
        if v != v or v in (float("inf"), float("-inf")):
            _rt.loss_bad = v
        else:
            _rt.loss_sum += v
            _rt.loss_n += 1
    if grad_norm is not None:
        g, m = float(grad_norm), _rt.gnorm_max
        if m is None or (m == m and (g != g or g > m)):     # a NaN, once there, stays
            _rt.gnorm_max = g


def _pop_signals():
    """(loss, grad norm) of the interval for the beat, and start a new interval."""
    loss = _rt.loss_bad if _rt.loss_bad is not None else (_rt.loss_sum / _rt.loss_n if _rt.loss_n else None)
    g = _rt.gnorm_max
    _rt.loss_sum, _rt.loss_n, _rt.loss_bad, _rt.gnorm_max = 0.0, 0, None, None
    return loss, g


def _replay_order():
    """The replay this attempt is (``protocol.ENV_REPLAY``), None for an ordinary one."""
    if not _rt.replay_parsed:
        _rt.replay_order = protocol.ReplayOrder.from_json(os.environ.get(protocol.ENV_REPLAY))
        _rt.replay_parsed = True
    return _rt.replay_order


def _node() -> str:
    return os.environ.get("SLURMD_NODENAME", "")


def _note_anomaly_evidence(hb_dir: str, step: int, loss: Optional[float], grad_norm: Optional[float]) -> None:
    """What the supervisor's replay of an anomaly needs from this rank: the first step whose
    loss or grad norm is not finite (reported once, at once: it says which node's ranks went
    bad first), and in a replay each replayed step's loss."""
    bad = next((v for v in (loss, grad_norm) if v is not None and not math.isfinite(v)), None)
    order = _replay_order()
    if order is not None:
        if loss is not None and order.from_step < step <= order.until:
            _rt.replay_losses[int(step)] = loss
        if bad is not None and _rt.replay_first_nf is None:
            _rt.replay_first_nf = int(step)
    if bad is not None and not _rt.nonfinite_reported:
        _rt.nonfinite_reported = True
        try:
            protocol.write_nonfinite(hb_dir, _rank(), step, _node(), bad)
        except OSError as e:
            log.warning("non-finite report of rank %d not written: %s", _rank(), e)


def _end_replay(hb_dir: str, step: int) -> None:
    """The replay reached its last step: report what it saw, leave the group, end (exit 0)."""
    try:
        protocol.write_replay_report(hb_dir, _rank(), reached=step, first_nonfinite=_rt.replay_first_nf,
                                     node=_node(), losses=_rt.replay_losses)
    except OSError as e:
        log.warning("replay report of rank %d not written: %s", _rank(), e)
    log.warning("replay: reached step %d; ending (%s)", step, protocol.ENV_REPLAY)
    shutdown()
    raise SystemExit(0)


def heartbeat(step: int, *, loss=None, grad_norm=None, force: bool = False) -> bool:
    """Record progress for the supervisor's hang detection.

    ``loss``, ``grad_norm``: this step's training signals for the supervisor's stability
    guard (``supervise: {stability: ...}``); a float (``loss.item()``, which the script
    usually has for logging anyway) or anything ``float()`` takes (a GPU tensor: that is a
    device sync). Every call adds to the interval's figures -- the mean loss and the largest
    grad norm; one that is not finite wins -- and the beat carries them: no I/O of its own.

    Reports the step through the supervisor's heartbeat channel (clusterops.heartbeat:
    node-local, one datagram per node; without an address, this rank's heartbeat file) at
    most once per HEARTBEAT_INTERVAL_S; other calls cost one clock read. Returns True
    when written.
    """
    if _rt.step_hook is not None:
        _rt.step_hook(step)
    d = os.environ.get(protocol.ENV_HEARTBEAT_DIR)
    if not d:
        return False
    if not _rt.replay_parsed:
        _replay_order()
    if loss is not None or grad_norm is not None:
        # One conversion each (a GPU tensor's float() is a device sync).
        loss = None if loss is None else float(loss)
        grad_norm = None if grad_norm is None else float(grad_norm)
        if (_rt.replay_order is not None or not (loss is None or math.isfinite(loss))
                or not (grad_norm is None or math.isfinite(grad_norm))):
            _note_anomaly_evidence(d, step, loss, grad_norm)
        _take_signals(loss, grad_norm)
    if _rt.replay_order is not None and step >= _rt.replay_order.until:
        _end_replay(d, step)
    now = time.monotonic()
    if not force and now - _rt.hb_at < HEARTBEAT_INTERVAL_S:
        return False
    _rt.hb_at = now
    rank = _rank()
    addr = os.environ.get(protocol.ENV_HEARTBEAT_ADDR)
    try:
        if addr and _rt.hb_refused != (addr, d):
            # The node channel (clusterops.heartbeat): node-local file, one datagram per node.
            from clusterops.heartbeat import ChannelRefused, NodeSender

            try:
                if _rt.hb_sender is None or _rt.hb_sender.addr != addr or _rt.hb_sender.hb_dir != d:
                    _rt.hb_sender = NodeSender(addr, d, rank, interval_s=HEARTBEAT_INTERVAL_S)
                    _watch_supervisor(_rt.hb_sender, rank)
                sig_loss, sig_gnorm = _pop_signals()
                _rt.hb_sender.beat(step, busy_s=_rt.busy_s if _rt.busy_known else None, paused=_rt.hb_paused,
                                   loss=sig_loss, grad_norm=sig_gnorm)
                _rt.busy_s, _rt.hb_paused = 0.0, False
            except ChannelRefused as e:
                # No token, or a node-local directory that is not ours alone (planted by
                # another user?): this rank's heartbeat file on the job directory, which
                # every channel mode of the supervisor also reads. Said once.
                log.warning("heartbeat channel refused (%s); rank %d writes its heartbeat file instead", e, rank)
                _rt.hb_sender, _rt.hb_refused = None, (addr, d)
                protocol.write_heartbeat(d, rank, step)
        else:
            protocol.write_heartbeat(d, rank, step)
    except OSError as e:
        # A heartbeat must never kill training; the supervisor sees staleness anyway.
        log.warning("heartbeat of rank %d in %s failed: %s", rank, d, e)
        return False
    return True


def check_replicas(step: int, tensors, *, every: Optional[int] = None, group=None):
    """Compare this rank's copy of the replicated parameters with the other replicas'.

    Call it once per step after the optimizer step, with what every rank of ``group`` (the
    whole world by default: DDP; for HSDP the replicate dimension's group) holds identically:
    ``model.parameters()``, and optionally the all-reduced gradients (``p.grad``). Every
    ``every`` steps (default: the contract variable ``protocol.ENV_REPLICA_CHECK_EVERY``, set by the supervisor from
    ``supervise: replica_check_every``, else 100; 0: never) each rank digests its tensors
    (clusterops.replicas: two int64 sums of their bits, one pass over the memory) and the group
    all-gathers the digests (16 bytes a rank): one small collective. Other steps cost a modulo.

    Returns None on a step without a check, else a :class:`clusterops.replicas.Verdict`:
    ``agree``, or the ``suspects`` (global ranks outside the strict majority) or ``ambiguous``
    (no strict majority: with two replicas nobody can be named). Under the supervisor the
    lowest rank reports it (``protocol.write_replicas``); on a disagreement the supervisor
    kills the step and rolls back to the newest checkpoint at or before the last agreeing
    check, keeping the suspects' nodes out. All ranks of the world must call it at the same
    steps (it is a collective). Test hook: ``CLUSTEROPS_REPLICA_FLIP`` (clusterops.replicas).
    """
    from clusterops import replicas as rp

    if every is None:
        every = _env_int(protocol.ENV_REPLICA_CHECK_EVERY, default=rp.DEFAULT_EVERY)
    hb_dir = os.environ.get(protocol.ENV_HEARTBEAT_DIR) or None
    flip = rp.parse_flip(os.environ.get(rp.FLIP_ENV))
    if flip is not None and step == flip[0] and _rank() == flip[1] and not _rt.flip_done:
        tensors = list(tensors)
        _rt.flip_done = True
        if rp.claim_flip(hb_dir):
            rp.flip_one_bit(tensors, flip[2], flip[3])
            log.warning("%s: flipped bit %d of tensor %d of rank %d's parameters at step %d (test hook)",
                        rp.FLIP_ENV, flip[2], flip[3], flip[1], step)
    if every <= 0 or step % every:
        return None
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return rp.Verdict(step, True)
    world_group = group is None
    backend = dist.get_backend(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = rp.digest(tensors, device=dev)
    n = dist.get_world_size(group)
    got = [torch.empty_like(mine) for _ in range(n)]
    dist.all_gather(got, mine, group=group)
    verdict = rp.judge(step, [(int(g[0]), int(g[1])) for g in got])
    members = list(range(n)) if world_group else [dist.get_global_rank(group, i) for i in range(n)]
    suspects = tuple(members[i] for i in verdict.suspects)
    ambiguous = verdict.ambiguous
    if not world_group:
        # Several replica groups: one more small all-gather over the world, so that one rank
        # can report every group's word (suspect, ambiguous) in one file.
        me = torch.tensor([int(dist.get_rank() in suspects), int(ambiguous)], dtype=torch.int64, device=dev)
        allw = [torch.empty_like(me) for _ in range(dist.get_world_size())]
        dist.all_gather(allw, me)
        suspects = tuple(r for r, t in enumerate(allw) if int(t[0]))
        ambiguous = any(int(t[1]) for t in allw)
    groups = {k: [members[i] for i in v] for k, v in verdict.groups.items()}
    verdict = rp.Verdict(step, not suspects and not ambiguous, suspects, ambiguous and not suspects, groups)
    if verdict.agree:
        _rt.replicas_last_agree = step
    if not verdict.agree:
        log.warning("replica check at step %d: %s", step,
                    f"ranks {list(suspects)} differ from the majority" if suspects
                    else "replicas differ and no majority says which")
    # The first disagreement stays the word (a later check must not hide the step it was
    # first seen at, should the supervisor look only after it).
    if hb_dir and dist.get_rank() == 0 and not _rt.replicas_bad_reported:
        _rt.replicas_bad_reported = not verdict.agree
        try:
            protocol.write_replicas(hb_dir, dict(verdict.report(dist.get_world_size()),
                                                 last_agree=_rt.replicas_last_agree))
        except OSError as e:
            log.warning("replica check report in %s not written: %s", hb_dir, e)
    return verdict


def report_suspects(*, nodes=(), ranks=(), why: str = "") -> bool:
    """Name the nodes (by Slurm name) and/or ranks this run suspects, before exiting with a
    code the job maps to ``relaunch_without_suspects`` (Megatron-LM's 16 by default): the
    supervisor leaves them out of the relaunch (drained with ``drain_bad_nodes``). Any rank
    may call it; what several ranks name is merged. ``nodes=[socket.gethostname()]`` does not
    name a Slurm node: use ``os.environ["SLURMD_NODENAME"]``. Never raises; True when written."""
    d = os.environ.get(protocol.ENV_HEARTBEAT_DIR)
    if not d:
        return False
    try:
        protocol.write_suspects(d, _rank(), [str(n) for n in nodes], [int(r) for r in ranks], why)
    except (OSError, ValueError) as e:
        log.warning("suspects not reported: %s", e)
        return False
    return True


def _dump_flight_recorder(request: int) -> None:
    """Answer the supervisor's dump request ``request`` (a hang's stack capture) from the
    watch thread: torch's flight recorder (the process groups' collective sequence numbers
    and the last entries; ``TORCH_FR_BUFFER_SIZE``, which the supervisor sets) as JSON in the
    heartbeat directory, with the process id (the supervisor matches NCCL's RAS report to
    the job by it). Never raises; a build without the recorder writes why."""
    import json

    d = os.environ.get(protocol.ENV_HEARTBEAT_DIR)
    if not d:
        return
    rank = _rank()
    try:
        import torch._C._distributed_c10d as c10d

        body = json.loads(c10d._dump_fr_trace_json(True, False))
        doc = {"rank": rank, "request": request, "pid": os.getpid(), "version": body.get("version"),
               "pg_status": body.get("pg_status") or {}, "pg_config": body.get("pg_config") or {},
               "entries": [{k: e.get(k) for k in ("collective_seq_id", "profiling_name", "state", "process_group")}
                           for e in (body.get("entries") or [])[-16:]]}
    except Exception as e:  # noqa: BLE001 - no recorder, no process group: say so
        doc = {"rank": rank, "request": request, "pid": os.getpid(), "error": f"{type(e).__name__}: {e}"[:300]}
    try:
        protocol.write_flightrec(d, rank, doc)
    except OSError as e:
        log.warning("flight-recorder dump of rank %d not written: %s", rank, e)


def _watch_supervisor(sender, rank: int) -> None:
    """Watch the supervisor through the two-way channel (clusterops.watchdog): when the
    batch host is lost, the ranks save if they can and requeue the job."""
    from clusterops.watchdog import Watchdog

    if _rt.watchdog is not None:
        _rt.watchdog.close()
    _rt.watchdog = Watchdog(sender, rank=rank, on_lost=request_stop, on_dump=_dump_flight_recorder)
    if not _rt.watchdog_at_exit:
        _rt.watchdog_at_exit = True
        atexit.register(lambda: _rt.watchdog is not None and _rt.watchdog.at_exit())


# ----------------------------------------------------------------------------- RNG


def get_rng_state() -> dict:
    """RNG states of python, numpy (if importable) and torch (+CUDA if initialized)."""
    import torch

    py = random.getstate()
    out = {"python": [py[0], list(py[1]), py[2]], "torch": torch.get_rng_state()}
    try:
        import numpy as np
    except ImportError:
        np = None
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = [name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(state: dict) -> None:
    import torch

    v, internal, gauss = state["python"]
    random.setstate((v, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ----------------------------------------------------------------------------- save


def _snapshot(obj: Any, pool: Optional[dict] = None) -> Any:
    """A copy that later training steps cannot change: tensors copied to CPU.

    ``pool`` maps a tensor's place in the state to the buffer the previous async
    save used for it; a buffer of the same shape and dtype is reused (no allocation,
    no page faults), which is most of the cost of the copy. Only called after the
    previous save finished, so those buffers are free.
    """
    import copy

    import torch

    new_pool = {}

    def walk(o, key):
        if isinstance(o, torch.Tensor):
            src = o.detach()
            buf = pool.get(key) if pool else None
            if (buf is not None and buf.shape == src.shape and buf.dtype == src.dtype
                    and buf.is_contiguous() and src.device.type == "cpu"):
                buf.copy_(src)
            else:
                buf = src.to("cpu", copy=True, memory_format=torch.contiguous_format)
            new_pool[key] = buf
            return buf
        if isinstance(o, dict):
            return {k: walk(v, key + (k,)) for k, v in o.items()}
        if isinstance(o, list):
            return [walk(v, key + (i,)) for i, v in enumerate(o)]
        if isinstance(o, tuple) and not hasattr(o, "_fields"):
            return tuple(walk(v, key + (i,)) for i, v in enumerate(o))
        return copy.deepcopy(o)

    out = walk(obj, ())
    if pool is not None:
        pool.clear()
        pool.update(new_pool)
    return out


class _AsyncSave:
    def __init__(self, step: int, fn):
        self.step = step
        self.result: Optional[Path] = None
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"ckpt-save-{step}", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # re-raised by wait()
            self.error = e

    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self) -> Optional[Path]:
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.result


def async_done() -> bool:
    """True when an async save was started and has finished (call wait() to collect it)."""
    return _rt.inflight is not None and _rt.inflight.done()


def async_in_flight() -> bool:
    return _rt.inflight is not None and not _rt.inflight.done()


def last_async_step() -> Optional[int]:
    return _rt.last_async_step


def _wait_at_exit() -> None:
    try:
        wait()
    except Exception as e:
        log.error("the last async checkpoint save failed: %s", e)


def wait() -> Optional[Path]:
    """Wait for the in-flight async save; raise its error if it failed."""
    job, _rt.inflight = _rt.inflight, None
    if job is None:
        return None
    _rt.hb_paused = True
    return job.join()


def save(state: dict, step: int, *, async_: bool = False, rank_state: Any = None,
         root: Optional[os.PathLike] = None, meta: Optional[dict] = None,
         algo: str = ck.DEFAULT_HASH) -> Optional[Path]:
    """Commit a checkpoint of state at step (all ranks call it with the same step).

    The RNG states are captured here. With async_=True the state is copied (tensors
    cloned to CPU) and written by a background thread while training continues; at
    most one save is in flight, so this first waits for the previous one, and an
    earlier async failure is raised here (or by wait()). Returns the committed path
    (None for an async save still in flight).

    ``state`` and ``rank_state`` may hold what :mod:`clusterops.checkpoint.codec` keeps:
    dict/OrderedDict/list/tuple with any plain keys, tensors (DTensors stay sharded with
    many ranks), numpy arrays, None/bool/int/float/str/bytes. Anything else raises
    ``UnsaveableState`` (exit code 2) naming its place, on every rank, before any write.
    """
    if _replay_order() is not None:
        # A replay of an anomaly (protocol.ENV_REPLAY) must leave the checkpoint root as it
        # found it: it reruns steps whose outcome is in question.
        log.info("replay: checkpoint of step %d not written", step)
        return None
    _rt.hb_paused = True      # the step time around a save is not a step time (stragglers)
    wait()
    _ensure_runtime()
    root = ckpt_root(root)
    enc, renc = _encode(state, rank_state)
    rng = get_rng_state()
    meta = dict(meta or {}, restart_count=restart_count())
    if async_:
        # The skeleton is a fresh plain structure already; only the tensors need a copy.
        enc.tensors = _snapshot(enc.tensors, _rt.snapshot_pool)
        renc.tensors = _snapshot(renc.tensors)
        snap, rsnap = enc, renc
        _rt.last_async_step = step
        if not _rt.atexit_registered:
            # A script that ends without wait() still gets its last checkpoint committed.
            atexit.register(_wait_at_exit)
            _rt.atexit_registered = True
        _rt.inflight = _AsyncSave(step, lambda: _save_now(snap, step, rng, rsnap, root, meta, algo))
        return None
    return _save_now(enc, step, rng, renc, root, meta, algo)


def _encode(state, rank_state):
    """Both states through the codec; a refusal on any rank is raised on every rank (one small
    collective), so no rank goes on into a save the others left."""
    d = _rt.dist
    err = None
    try:
        enc = codec.encode(state, distributed=d.distributed)
        renc = codec.encode(rank_state, root="rank_state")
    except codec.UnsaveableState as e:
        err = e.message
    except Exception as e:  # anything else that stops this rank must reach the others too
        err = f"{type(e).__name__}: {e}"
    if d.distributed:
        import torch.distributed as dist

        errs = [None] * d.world_size
        dist.all_gather_object(errs, err, group=_rt.ckpt_group)
        first = next(((r, m) for r, m in enumerate(errs) if m), None)
        if first is not None:
            r, m = first
            raise codec.UnsaveableState(m if r == d.rank else f"rank {r}: {m}")
    elif err is not None:
        raise codec.UnsaveableState(err)
    return enc, renc


def _save_now(enc, step, rng, renc, root: Path, meta, algo) -> Path:
    t0 = time.monotonic()
    d = _rt.dist
    extra = {"rng": rng, "rank_state": codec.to_blob(renc), "rank": d.rank, "step": int(step)}
    if not d.distributed:
        path = codec.save_one_process(root, step, enc, {rank_file(0): extra}, state_file=STATE_FILE, meta=meta,
                                      algo=algo)
    else:
        path = _save_distributed(enc, step, extra, root, meta, algo)
    log.info("checkpoint step %d committed at %s in %.2fs", step, path, time.monotonic() - t0)
    return path


def _save_distributed(enc, step, extra, root: Path, meta, algo) -> Path:
    """Each rank writes its DCP shard and its rank file, rank 0 the skeleton; rank 0 commits
    after all are done."""
    import hashlib

    import torch.distributed as dist

    d, pg = _rt.dist, _rt.ckpt_group
    # 1. rank 0 makes the temporary directory and tells everyone its name.
    box = [None]
    pending = None
    if d.rank == 0:
        try:
            pending = ck.PendingCheckpoint(root, step, algo=algo)
            (pending.path / DCP_DIR).mkdir()
            box[0] = ("ok", str(pending.path))
        except BaseException as e:
            box[0] = ("error", str(ck.wrap_save_error(e, root, step)))
            if pending is not None:
                pending.abort()
    dist.broadcast_object_list(box, src=0, group=pg)
    status, tmp = box[0]
    if status != "ok":
        raise ck.CheckpointError(tmp)
    tmp = Path(tmp)
    if pending is None:
        pending = ck.PendingCheckpoint(root, step, algo=algo, tmp_path=tmp)
    # 2. every rank: its DCP shard of the tensors (a collective; failures reach every rank)
    #    and its rank file; rank 0 the skeleton (the structure and every non-tensor value).
    error = None
    skeleton = enc.skeleton_bytes()
    try:
        codec.save_dcp(enc, tmp / DCP_DIR, pg)
    except BaseException as e:
        error = e
    if error is None and d.rank == 0:
        try:
            codec.write_skeleton(pending, skeleton)
        except BaseException as e:
            error = e
    if error is None:
        try:
            pending.write_torch(rank_file(d.rank), extra)
        except BaseException as e:
            error = e
    dist.barrier(group=pg)
    # 3. every rank hashes its share of the DCP files (rank 0 does not re-read 1/W of them).
    if error is None:
        try:
            names = sorted(str(p.relative_to(tmp)) for p in (tmp / DCP_DIR).rglob("*") if p.is_file())
            for i, name in enumerate(names):
                if i % d.world_size == d.rank:
                    pending.record_file(name)
        except BaseException as e:
            error = e
    report = {"rank": d.rank, "files": pending.files, "skeleton": hashlib.sha256(skeleton).hexdigest(),
              "error": None if error is None else str(ck.wrap_save_error(error, root, step))}
    reports = [None] * d.world_size if d.rank == 0 else None
    dist.gather_object(report, reports, dst=0, group=pg)
    # 4. rank 0 commits (or aborts) and tells everyone the outcome.
    box = [None]
    if d.rank == 0:
        errors = [f"rank {r['rank']}: {r['error']}" for r in reports if r["error"]]
        if errors:
            pending.abort()
            box[0] = ("error", "; ".join(errors))
        else:
            differ = [r["rank"] for r in reports if r["skeleton"] != report["skeleton"]]
            if differ:
                # Rank 0's skeleton is the state's: per-rank values belong in rank_state.
                log.warning("checkpoint step %d: the state's structure or non-tensor values differ on rank(s) %s "
                            "from rank 0's, which is what is saved (per-rank values go in rank_state)",
                            step, ",".join(map(str, differ)))
            for r in reports:
                pending.files.update(r["files"])
            try:
                path = pending.commit(world_size=d.world_size, kind="dcp", meta=meta, codec=codec.CODEC_VERSION)
                box[0] = ("ok", str(path))
            except BaseException as e:
                pending.abort()
                box[0] = ("error", str(ck.wrap_save_error(e, root, step)))
    dist.broadcast_object_list(box, src=0, group=pg)
    status, msg = box[0]
    if status != "ok":
        if error is not None and ck.is_disk_full(error):
            raise ck.CheckpointDiskFull(msg)
        if "no space left" in msg:
            raise ck.CheckpointDiskFull(msg)
        raise ck.CheckpointError(msg)
    return Path(msg)


# ----------------------------------------------------------------------------- resume


def _choose_checkpoint(root: Optional[os.PathLike], deep: bool, exclude=()) -> Optional[Path]:
    explicit = os.environ.get(protocol.ENV_RESUME_FROM)
    if explicit and Path(explicit) not in exclude:
        info = ck.verify(explicit, deep=deep)
        if info.ok:
            return Path(explicit)
        log.warning("%s=%s is not a good checkpoint (%s); looking for the latest good one",
                    protocol.ENV_RESUME_FROM, explicit, "; ".join(info.problems))
    if explicit and root is None and not os.environ.get(protocol.ENV_CKPT_DIR):
        root = Path(explicit).parent
    try:
        r = ckpt_root(root)
    except ClusteropsError:
        return None
    found = ck.find_latest_good(r, deep=deep, exclude=exclude)
    for bad in found.skipped:
        log.warning("skipped bad checkpoint %s: %s", bad.path, "; ".join(bad.problems))
    return found.latest.path if found.latest else None


def resume(*, root: Optional[os.PathLike] = None, template: Optional[dict] = None, deep: bool = False,
           restore_rng: bool = True, weights_only: bool = True) -> Optional[Resumed]:
    """The state to continue from, or None when there is no good checkpoint.

    Uses the supervisor's choice (protocol.ENV_RESUME_FROM) when set and good, else the
    latest good checkpoint under the root (bad ones are skipped and logged). With many
    ranks, rank 0 chooses and all ranks load the same checkpoint. The state comes back as it was
    saved (clusterops.checkpoint.codec). A DCP checkpoint with a ``template``: each template
    tensor at a path of the state is loaded in place (a DTensor keeps its sharding: each rank
    reads what it needs) and is the tensor in the returned state; tensors the template lacks
    are read in full on every rank. Without a template, everything in full.
    RNG states are restored (restore_rng=True) when this rank's file is present;
    call resume() after building the model so nothing consumes randomness afterwards.

    Files are loaded with ``weights_only=True``: nothing in a checkpoint can run code.
    A state holding objects that need pickled code raises ``UnsafeLoadRefused``;
    ``weights_only=False`` is the explicit opt-in for checkpoints you trust. One
    process: a checkpoint that verifies but cannot be loaded (corrupt content with
    a consistent manifest) is skipped like a bad one; with many ranks it raises
    ``CheckpointError`` on every rank.
    """
    t0 = time.monotonic()
    r = _resume(root, template, deep, restore_rng, weights_only)
    if _rt.resume_hook is not None:
        _rt.resume_hook(r, time.monotonic() - t0)
    return r


def _resume(root, template, deep: bool, restore_rng: bool, weights_only: bool) -> Optional[Resumed]:
    d = _ensure_runtime()
    if d.distributed:
        import torch.distributed as dist

        box = [None]
        if d.rank == 0:
            try:
                p = _choose_checkpoint(root, deep)
                box[0] = ("ok", str(p) if p else None)
            except Exception as e:  # every rank must hear about it, not wait forever
                box[0] = ("error", f"{type(e).__name__}: {e}")
        dist.broadcast_object_list(box, src=0, group=_rt.ckpt_group)
        status, chosen = box[0]
        if status != "ok":
            raise ck.CheckpointError(f"choosing the checkpoint to resume from failed on rank 0: {chosen}")
        path = Path(chosen) if chosen else None
        if path is None:
            return None
        return _load_resumed(path, d, template, restore_rng, weights_only)
    tried: set = set()
    while True:
        path = _choose_checkpoint(root, deep, exclude=tried)
        if path is None:
            return None
        try:
            return _load_resumed(path, d, template, restore_rng, weights_only)
        except ck.UnsafeLoadRefused:
            raise  # not corrupt: falling back to an older one would hide it
        except ck.CheckpointError as e:
            log.warning("skipped checkpoint %s: %s", path, e.message)
            tried.add(path)


def resume_hint(step: Optional[int] = None) -> Optional[protocol.ResumeHint]:
    """The supervisor's decision for this attempt (``protocol.ENV_RESUME_HINT``), None when
    there is none; with ``step``, only when it was made for the checkpoint of that step."""
    hint = protocol.ResumeHint.from_json(os.environ.get(protocol.ENV_RESUME_HINT, ""))
    if hint is None or (step is not None and hint.from_step != step):
        return None
    return hint


def _load_resumed(path: Path, d, template, restore_rng: bool, weights_only: bool) -> Resumed:
    try:
        manifest = ck.read_manifest(path)
        step = manifest["step"]
        if manifest.get("kind") == "dcp":
            state = codec.load_dcp_state(path, DCP_DIR, manifest, template, _rt.ckpt_group,
                                         weights_only=weights_only)
        else:
            state = codec.load_torch_state(path, STATE_FILE, manifest, weights_only=weights_only)
        extra = None
        rf = rank_file(d.rank)
        if rf in manifest["files"] and manifest.get("world_size", 1) == d.world_size:
            extra = ck.load_torch(path, rf, weights_only=weights_only)
            if not isinstance(extra, dict):
                raise ck.CheckpointError(f"{path / rf}: not a rank file (a {type(extra).__name__})")
        else:
            log.warning("checkpoint %s has no rank file for rank %d of %d (saved by %s ranks); RNG not restored",
                        path, d.rank, d.world_size, manifest.get("world_size"))
        rank_state = extra.get("rank_state") if extra else None
        if extra is not None and codec.codec_version(manifest) is not None:
            rank_state = codec.from_blob(rank_state, str(path / rf))
        rng_restored = False
        if extra is not None and restore_rng:
            set_rng_state(extra["rng"])
            rng_restored = True
    except ck.CheckpointError:
        raise
    except Exception as e:  # torch/pickle/zip errors on damaged content: one line
        msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
        raise ck.CheckpointError(f"{path}: cannot be loaded ({type(e).__name__}: {msg})") from None
    return Resumed(step=step, state=state, rank_state=rank_state,
                   path=path, manifest=manifest, rng_restored=rng_restored, hint=resume_hint(step))
