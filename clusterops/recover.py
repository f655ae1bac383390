"""The SDK's recoverable training loop: survivors heal in-process, a lost rank's state comes
from a peer.

    from clusterops import recover, sdk

    state = MyState(model, opt, sched)       # .step, .state_dict(), .load_state_dict()
    def train(gen):                          # gen.rank, gen.world_size, gen.restored
        if not gen.restored:
            ...sdk.resume() into state...    # generation 0 (or a relaunch): from disk
        while state.step < steps:
            ...one step; collectives on the default group...
            sdk.heartbeat(state.step)
        return result
    result = recover.run(train, state)       # None in a standby that was never needed

Under ``clusterops supervise`` with ``supervise: inprocess:`` every node runs the ranks
and warm standbys (the script has imported torch and built its state; they wait at the
rendezvous). :func:`run` owns the process group's life: it joins the supervisor's
rendezvous (:data:`clusterops.protocol.ENV_RDZV_ADDR`), learns its rank from the plan
(:mod:`clusterops.supervisor.membership` decides it), forms the group on that generation's
prefix of the supervisor's ``TCPStore`` and calls ``train``. When a collective raises (a
dead peer's socket on gloo), the rank reports it, destroys the group, waits for the next
generation, re-forms the group, loads the state a survivor broadcasts (the survivor at the
highest step: model, optimizer, scheduler, data position, whatever ``state_dict`` holds,
bit for bit) and calls ``train`` again at that step.

Trust: every value in the store is sealed with the attempt's secret
(:mod:`clusterops.rdzvstore`), so a plan, a kill order or an abort that does not open is
nobody's and is ignored; a standby kills only a process the current plan names that is of
its own job and attempt (its environment says so). Once a generation's group is formed,
every rank proves it holds the secret in one small all-gather (:func:`_verify_group`): a
stranger who raced into a gloo connection makes the formation fail (the relaunch follows), it
never trains with the job. The state goes as bytes of ``torch.save`` and is loaded with
``weights_only=True``: tensors and plain data only, nothing a peer sends can run code.
``state_dict()`` must therefore hold what ``torch.load(weights_only=True)`` loads
(tensors, numbers, strings, lists, tuples, dicts; what the SDK's checkpoints hold). A standby that is given a rank does the
same, with no interpreter start and no checkpoint read. Per-rank randomness is not state a
peer holds: derive it from ``(seed, rank, step)`` (:func:`seed_step`), so a rank that takes
over draws what the lost one would have drawn.

On NCCL a collective blocked on a lost peer never returns by itself (the kernel waits on
the GPU): a watcher thread of each rank (:class:`AbortWatch`, its own store connection)
waits for the host's ``abort/<G+1>``, set as soon as a fault opens the next generation, and
aborts the process group (``torch.distributed.distributed_c10d._abort_process_group``), so
the blocked collective raises and the rank goes the survivors' way. gloo needs no watcher
(a dead peer's socket fails the collective); the watcher is started for NCCL only
(``abort_watch=`` forces it either way). It has not run on a GPU here: the wait, the key and
the call are tested with a real store and a stand-in for the abort.

Sharded state (FSDP2): no survivor holds all of it, and the lost rank's shards died with it.
``run(train, state, sharded=True)``: ``state`` needs only ``.step`` (the step this process
has reached), and ``train`` builds the sharded model and optimizer itself, on the group it is
called in (``fully_shard`` binds its mesh when it wraps; the old generation's group is
destroyed)::

    def train(gen):                          # gen.from_checkpoint after a fault
        model, opt = build_and_shard()       # on this generation's default group
        r = sdk.resume(template=...)         # the latest good checkpoint, every rank
        ...
    recover.run(train, state, sharded=True)

After a fault the survivors and the standbys that take the lost ranks form the new
generation's group exactly as in the replicated case, then ``train`` is called with
``restored=False`` and ``from_checkpoint=True``: every rank, survivor or standby, rebuilds
and resumes from the latest good checkpoint (the launch's resume variable,
``protocol.ENV_RESUME_FROM``, no longer applies: it named where the launch started) and
recomputes the steps since. Nothing
is broadcast and no interpreter starts. If ``state`` has a ``discard()`` method it is called
when a collective failed, before the group is destroyed: drop the model and optimizer there
(their DTensors hold the old group; while they live its sockets stay open and a peer blocked
on this rank waits out its timeout instead of failing at once). Rank 0 reports what it
loaded (``state``: ``source="checkpoint"``, the checkpoint's ``step``, the survivors'
``survivors_step``, ``recomputed`` = the difference, the seconds ``sdk.resume`` took) and
its first step past the checkpoint (``step``), which ends the recovery: ``train`` must call
``sdk.resume()`` in such a generation (None without a checkpoint: it starts at step 0), or the
recovery never ends and the supervisor falls back to its relaunch. The in-memory path
(a survivor keeping its own shards, only the lost ranks' shards read from disk) is not built.

Without the rendezvous address (a plain ``torchrun`` or ``srun``, or no ``inprocess:``)
:func:`run` is ``sdk.init_distributed()`` plus one call of ``train``: the same script runs
unsupervised and under the relaunch path.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from clusterops import protocol
from clusterops import rdzvstore
from clusterops import sdk
from clusterops.errors import ClusteropsError

log = logging.getLogger(__name__)

STANDBY_POLL_S = 0.02
PG_TIMEOUT_S = 60.0


class RecoveryAbandoned(ClusteropsError):
    """The supervisor gave the in-process path up (its full relaunch follows)."""


class GroupNotAuthentic(ClusteropsError):
    """A member of a newly formed group could not prove it holds the attempt's secret."""


@dataclass(frozen=True)
class Generation:
    """What ``train`` is called with: this process's place in the current generation."""

    gen: int
    rank: int
    world_size: int
    restored: bool           # the state came from a peer (no checkpoint to load)
    step: Optional[int]      # the step that state holds (None in generation 0): the survivors' step
    #: sharded mode, after a fault: rebuild the model on this generation's group and resume
    #: from the latest good checkpoint (the steps since are recomputed)
    from_checkpoint: bool = False


def seed_step(seed: int, rank: int, step: int) -> None:
    """Seed python's, numpy's and torch's RNGs from (seed, rank, step): randomness that a rank
    taking over at ``step`` reproduces without any state from the lost process."""
    import torch

    s = (int(seed) * 1_000_003 + int(rank) * 7_919 + int(step)) % (2 ** 31 - 1)
    random.seed(s)
    torch.manual_seed(s)
    try:
        import numpy as np

        np.random.seed(s)
    except ImportError:
        pass


def send_report(store: rdzvstore.SealedStore, uid: str, kind: str, **data: Any) -> None:
    """A report to the rendezvous (:mod:`clusterops.protocol`'s ``rep/n``): two round trips."""
    n = store.add(protocol.RDZV_REPORTS, 1)
    store.set(protocol.rdzv_key("rep", n), json.dumps({"kind": kind, "uid": uid, **data}))


def send_join(store: rdzvstore.SealedStore, gen: int, uid: str, rank: int, step: int) -> None:
    """A survivor asks for generation ``gen`` holding ``step``: one round trip (``join/<gen>``)."""
    store.append(protocol.rdzv_key("join", gen), protocol.rdzv_join_line(uid, rank, step))


class _Client:
    def __init__(self, addr: str, timeout_s: float):
        self.addr, self.timeout_s = addr, float(timeout_s)
        self.store = rdzvstore.connect(addr, timeout_s)
        self.node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
        self.uid = f"{self.node}:{os.getpid()}"
        self._watch_store: Optional[rdzvstore.SealedStore] = None

    def watch_store(self) -> rdzvstore.SealedStore:
        """A second connection to the store, for :class:`AbortWatch` (its wait blocks one)."""
        if self._watch_store is None:
            self._watch_store = rdzvstore.connect(self.addr, self.timeout_s)
        return self._watch_store

    def beat(self) -> None:
        """This node lives (``beat/<node>``: a sealed time stamp)."""
        self.store.set(protocol.rdzv_key("beat", self.node), protocol.rdzv_beat(time.time()))

    def report(self, kind: str, **data: Any) -> None:
        send_report(self.store, self.uid, kind, **data)

    def fail(self, gen: int, rank: int, step: int, error: str) -> None:
        """This rank's collective failed in ``gen``: only the first rank to say so sends the
        report (one round trip for the others; each of them joins next anyway)."""
        if self.store.first(protocol.rdzv_key("fail", gen), self.uid):
            self.report("fail", gen=gen, rank=rank, step=step, error=error)

    def join(self, gen: int, rank: int, step: int) -> None:
        send_join(self.store, gen, self.uid, rank, step)

    def finished(self) -> Optional[str]:
        value = self.store.peek(protocol.RDZV_FINISH)
        return None if value is None else value.decode()

    def plan(self, gen: int, *, wait: bool) -> Optional[dict]:
        """Generation ``gen``'s plan, once an authentic one is there (a forged one is waited past)."""
        key = protocol.rdzv_key("plan", gen)
        while True:
            value = self.store.peek(key)
            if value is not None:
                return json.loads(value)
            if not wait:
                return None
            why = self.finished()
            if why is not None:
                raise RecoveryAbandoned(f"the supervisor ended the in-process recovery ({why}) "
                                        f"before generation {gen}")
            time.sleep(STANDBY_POLL_S)


def _abort_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.distributed_c10d._abort_process_group()


class AbortWatch:
    """A thread that aborts this rank's process group when the host says generation ``gen``
    is being formed (``abort/<gen>``): a collective blocked on a lost peer then raises.
    ``store``: a store connection of the watcher's own (a blocking ``wait`` holds it);
    ``abort``: what to call (the whole process group's abort by default)."""

    WAIT_S = 1.0

    def __init__(self, store: rdzvstore.SealedStore, gen: int, abort: Callable[[], None] = _abort_world):
        self.store, self.key, self.abort = store, protocol.rdzv_key("abort", gen), abort
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"clusterops-abort-{gen}", daemon=True)

    def start(self) -> "AbortWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        """No abort from now on (the generation ended on its own); returns at once."""
        self._stop.set()

    def _loop(self) -> None:
        import datetime

        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.store.raw.wait([self.key], datetime.timedelta(seconds=self.WAIT_S))
                authentic = self.store.peek(self.key) is not None
            except Exception:    # the wait timed out (or the store is gone: do not spin)
                if time.monotonic() - t0 < self.WAIT_S / 2:
                    self._stop.wait(self.WAIT_S)
                continue
            if not authentic:    # a stranger's value: not the host's word; look again shortly
                self._stop.wait(self.WAIT_S / 10)
                continue
            if not self._stop.is_set():
                self.fired = True
                try:
                    self.abort()
                except Exception as e:   # the group may be half torn down already: it is going
                    log.warning("abort of the process group: %s", e)
            return


STOPPED_S = 1.0


def _pid_state(pid: int) -> str:
    """The process's state letter (``/proc/<pid>/stat``); "X" when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def _of_this_attempt(pid: int) -> bool:
    """Whether process ``pid`` belongs to this job and attempt: its environment carries the same
    Slurm job and the same rendezvous address (with its secret). Never a stranger's process,
    nor one that took over a dead rank's pid."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return False
    mine = {k: os.environ.get(k, "").encode() for k in ("SLURM_JOB_ID", protocol.ENV_RDZV_ADDR)}
    return bool(mine[protocol.ENV_RDZV_ADDR]) and all(env.get(k.encode(), b"") == v for k, v in mine.items())


def _standby(client: _Client, plan: dict) -> Optional[dict]:
    """Wait as a warm standby: watch this node's ranks (report a death, carry out a kill)
    until a plan gives this process a rank, or the training ends (None)."""
    reported, killed, stop_said, stopped_since = set(), set(), set(), {}
    beat_at = 0.0
    while True:
        if time.monotonic() - beat_at >= protocol.RDZV_BEAT_S:
            beat_at = time.monotonic()
            client.beat()
        nxt = client.plan(plan["gen"] + 1, wait=False)
        if nxt is not None:
            plan = nxt
            if client.uid in plan["ranks"]:
                return plan
            continue
        if client.finished() is not None:
            return None
        here = [u for u in plan["ranks"] if u.rpartition(":")[0] == client.node]
        for uid in here:
            pid = int(uid.rpartition(":")[2])
            if uid not in killed and client.store.peek(protocol.rdzv_key("kill", uid)) is not None:
                killed.add(uid)
                if _of_this_attempt(pid):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
                else:
                    log.warning("kill order for %s: pid %d is not a process of this attempt; not killed", uid, pid)
            if uid in reported:
                continue
            st = _pid_state(pid)
            if st in ("Z", "X"):
                reported.add(uid)
                client.report("dead", dead=uid)
            elif st in ("T", "t"):      # stopped (SIGSTOP, a debugger): a hang seen from the node
                since = stopped_since.setdefault(uid, time.monotonic())
                if time.monotonic() - since >= STOPPED_S and uid not in stop_said:
                    stop_said.add(uid)  # said once; the supervisor's kill order comes back here
                    client.report("stopped", dead=uid, seconds=round(time.monotonic() - since, 2))
            else:
                stopped_since.pop(uid, None)
        time.sleep(STANDBY_POLL_S)


def _form(client: _Client, plan: dict, rank: int, backend: str) -> None:
    import datetime

    import torch.distributed as dist

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(plan["world"])})
    pg_store = dist.PrefixStore(protocol.rdzv_key("pg", plan["gen"]), client.store.torch_store)
    sdk._keep_group_collectable()      # else an earlier generation's group would outlive its teardown
    dist.init_process_group(backend=backend, store=pg_store, rank=rank, world_size=plan["world"],
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    _verify_group(client.store.sealer, int(plan["gen"]), rank, int(plan["world"]), backend)
    sdk._adopt_group(rank, plan["world"], backend)


def _device(backend: str) -> Any:
    import torch

    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _verify_group(sealer: rdzvstore.Sealer, gen: int, rank: int, world: int, backend: str) -> None:
    """Every member of the group just formed holds the attempt's secret: one all-gather of a
    16-byte tag a rank (:func:`clusterops.rdzvstore.group_tags`). The addresses the group formed
    on were sealed, but torch's transports do not authenticate a connection; a stranger who
    got into one cannot send the tag of the rank it poses as. Raises GroupNotAuthentic."""
    import torch
    import torch.distributed as dist

    tags = rdzvstore.group_tags(sealer, gen, world)
    dev = _device(backend)
    mine = torch.tensor(list(tags[rank]), dtype=torch.uint8, device=dev)
    got = [torch.empty(len(tags[rank]), dtype=torch.uint8, device=dev) for _ in range(world)]
    dist.all_gather(got, mine)
    bad = [r for r, t in enumerate(got) if bytes(t.cpu().tolist()) != tags[r]]
    if bad:
        raise GroupNotAuthentic(f"generation {gen}: rank(s) {bad[:8]} of the new process group could not "
                                f"prove the attempt's secret; this process leaves the group")


def _teardown() -> None:
    import torch.distributed as dist

    sdk._drop_group()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as e:   # a broken group may complain on the way out; it is gone either way
            log.warning("destroy_process_group: %s", e)
    gc.collect()   # the gloo pairs close when their context is freed


def _transfer(state: Any, src: int, rank: int, backend: str = "gloo") -> float:
    """Every rank loads the state of rank ``src`` (two broadcasts: the size, then the bytes of
    ``torch.save``); seconds it took. Loaded with ``weights_only=True``: no pickle a peer could
    forge is ever run (``broadcast_object_list`` would unpickle whatever arrives)."""
    import io

    import torch
    import torch.distributed as dist

    t0 = time.monotonic()
    dev = _device(backend)
    if rank == src:
        buf = io.BytesIO()
        torch.save(state.state_dict(), buf)
        payload = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src=src)
    if rank != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    wire = payload.to(dev)
    dist.broadcast(wire, src=src)
    if rank != src:
        data = bytes(wire.cpu().untyped_storage())
        state.load_state_dict(torch.load(io.BytesIO(data), weights_only=True, map_location=dev))
    return time.monotonic() - t0


def _is_peer_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    return isinstance(e, (dist.DistError, ConnectionError)) or (
        isinstance(e, RuntimeError) and any(w in str(e) for w in ("Connection", "connection", "gloo", "Gloo",
                                                                   "closed", "reset by peer", "Timed out")))


class _Reporter:
    """Rank 0's reports of one generation: where the state came from, and the first step."""

    def __init__(self, client: "_Client", plan: dict, rank: int, restored: bool, from_ckpt: bool):
        self.client, self.gen, self.rank = client, int(plan["gen"]), rank
        self.survivors = int(plan["step"] or 0)
        self.restored, self.from_ckpt = restored, from_ckpt
        # the step the new generation starts from: the survivors' (a broadcast) or, loaded from
        # disk, the checkpoint's (known once sdk.resume returned: 0 when there is none)
        self.base: Optional[int] = self.survivors if restored else None
        self.recomputed: Optional[int] = None
        self.pending = restored or from_ckpt

    def on_resume(self, r: Any, seconds: float) -> None:
        if not self.from_ckpt or self.base is not None:
            return
        self.base = int(r.step) if r is not None else 0
        self.recomputed = max(0, self.survivors - self.base)
        if self.rank == 0:
            self.client.report("state", gen=self.gen, seconds=round(seconds, 4), source="checkpoint",
                               step=self.base, survivors_step=self.survivors, recomputed=self.recomputed,
                               path=str(r.path) if r is not None else None)

    def on_step(self, step: int) -> None:
        # From the checkpoint, a beat before sdk.resume() returned is the old state's, not a step
        # of this generation: the first step is counted from the step resumed.
        if not self.pending or self.rank != 0 or self.base is None or step <= self.base:
            return
        self.pending = False
        extra = {"recomputed": self.recomputed, "from_step": self.base} if self.from_ckpt else {}
        self.client.report("step", gen=self.gen, step=int(step), **extra)


def run(train: Callable[[Generation], Any], state: Any, *, backend: str = "gloo",
        timeout_s: float = PG_TIMEOUT_S, sharded: bool = False, abort_watch: Optional[bool] = None) -> Any:
    """Run ``train`` under in-process recovery (see the module); its result on a rank, None on a
    standby that was never given one. ``state``: ``.step`` (int), ``state_dict()``,
    ``load_state_dict(d)``; with ``sharded=True`` only ``.step`` (and optionally ``discard()``):
    after a fault every rank resumes from the latest good checkpoint instead of receiving a
    survivor's state. ``abort_watch``: run the NCCL abort watcher (default: for
    ``backend="nccl"`` only)."""
    watch_on = backend == "nccl" if abort_watch is None else bool(abort_watch)
    addr = os.environ.get(protocol.ENV_RDZV_ADDR)
    if not addr:
        d = sdk.init_distributed(backend)
        return train(Generation(0, d.rank, d.world_size, restored=False, step=None))
    sdk.install_stop_handlers()
    client = _Client(addr, timeout_s)
    client.beat()
    client.report("hello", node=client.node, local=int(os.environ.get("SLURM_LOCALID") or 0),
                  task=int(os.environ.get("SLURM_PROCID") or -1))
    plan = client.plan(0, wait=True)
    newcomer = False      # a standby given a rank holds only the state it built at start
    while True:
        if client.uid not in plan["ranks"]:
            plan = _standby(client, plan)
            if plan is None:
                return None
            newcomer = True
        rank, gen = int(plan["ranks"][client.uid]), int(plan["gen"])
        if plan["src"] is not None and not sharded and newcomer and rank == int(plan["src"]):
            raise RecoveryAbandoned(f"generation {gen} names this newcomer (rank {rank}) as the state source: "
                                    f"it holds no trained state; refusing to send it")
        _form(client, plan, rank, backend)
        watch = AbortWatch(client.watch_store(), gen + 1).start() if watch_on else None
        after_fault = plan["src"] is not None
        restored, from_ckpt = after_fault and not sharded, after_fault and sharded
        if from_ckpt:
            # The launch's pinned checkpoint is where the launch started; the survivors have
            # saved newer ones since: resume() takes the latest good one.
            os.environ.pop(protocol.ENV_RESUME_FROM, None)
        rep = _Reporter(client, plan, rank, restored, from_ckpt)
        try:
            if restored:
                took = _transfer(state, int(plan["src"]), rank, backend)
                newcomer = False
                if rank == 0:
                    client.report("state", gen=gen, seconds=round(took, 4), src=int(plan["src"]), step=state.step)
            sdk._set_step_hook(rep.on_step)
            sdk._set_resume_hook(rep.on_resume)
            result = train(Generation(gen, rank, int(plan["world"]), restored=restored, step=plan["step"],
                                      from_checkpoint=from_ckpt))
        except Exception as e:
            # After our own abort any collective fails, in whatever words: it is the fault's.
            if not _is_peer_failure(e) and not (watch is not None and watch.fired):
                raise
            failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        else:
            failed = None
        finally:
            if watch is not None:
                watch.stop()
        if failed is not None:
            # Out of the except clause: the exception's traceback no longer holds the broken
            # group, so destroying it closes its sockets now, and the peers still blocked on
            # this rank fail at once instead of at their timeout.
            log.warning("generation %d, rank %d: a collective failed (%s); waiting for generation %d",
                        gen, rank, failed, gen + 1)
            client.fail(gen, rank, int(state.step), failed[:200])
            sdk._set_step_hook(None)
            sdk._set_resume_hook(None)
            if sharded and callable(getattr(state, "discard", None)):
                state.discard()      # the sharded model holds the old group: drop it first
            _teardown()
            client.join(gen + 1, rank, int(state.step))
            plan = client.plan(gen + 1, wait=True)
            continue
        sdk._set_step_hook(None)
        sdk._set_resume_hook(None)
        client.report("done", rank=rank, step=int(state.step))
        return result
