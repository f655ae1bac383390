"""The ranks' watch on their supervisor (clusterops.watchdog) against the real receiver.

Real UDP sockets, the real node-local directories and the real receiver thread of
clusterops.supervisor.channel; only Slurm is the recorded fake (its job and node reads).
The batch host's loss is the receiver closed *and* Slurm saying the node is down (the
watch acts on Slurm's word only); a network pause is the receiver closed with Slurm saying
the node is fine; a relaunch is the next ``attempt-<N+1>`` made before the receiver closes;
a slow supervisor is a receiver whose answers come late; a flaky controller is
``FlakySlurm`` (chosen calls time out).
"""

from __future__ import annotations

import threading
import time

import pytest

from support.fakes import FakeSlurm, FlakySlurm
from clusterops import heartbeat as hbc
from clusterops import watchdog as wd
from clusterops.slurm.parse import JobInfo, NodeInfo
from clusterops.supervisor import channel as ch
from clusterops.supervisor import timeline as tl


def wait_for(cond, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def job(state="RUNNING", restarts=0, nodes=("node1", "node2", "node3")):
    return JobInfo(job_id=77, name="t", state=state, category="running", node_names=tuple(nodes),
                   restart_count=restarts, batch_host="node1")


DOWN = dict(host_state="down", host_flags=frozenset({"NOT_RESPONDING"}))   # what Slurm says of a lost node


def slurm_with(host_state="allocated", host_flags=frozenset(), cls=FakeSlurm, slurm_kw=None, **kw):
    return cls(nodes=[NodeInfo("node1", host_state, host_flags), NodeInfo("node2", "allocated")], jobs=[job(**kw)],
               **(slurm_kw or {}))


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.setattr(wd, "STAGGER_S", 0.3)
    made = []

    def make(lost_s=1.5):
        rx = ch.Receiver("tok1", bind_host="127.0.0.1", lost_after_s=lost_s).start()
        att = tmp_path / "job" / "attempt-0"
        (att / "heartbeat").mkdir(parents=True, exist_ok=True)
        addr = f"127.0.0.1:{rx.port}/tok1"
        made.append(rx)
        return rx, addr, att

    yield make
    for rx in made:
        rx.close()


def watch(addr, att, tmp_path, rank, node, slurm, **kw):
    sender = hbc.NodeSender(addr, str(att / "heartbeat"), rank, node=node, root=str(tmp_path / "shm"),
                            interval_s=0.2)
    sender.beat(5)
    lost = []
    w = wd.Watchdog(sender, rank=rank, job_id="77", incarnation=0, slurm_factory=lambda: slurm,
                    on_lost=lost.append, **kw)
    return w, lost


def test_codec_ping_and_beacon_are_version_1_and_old_datagrams_still_decode():
    ping = hbc.encode(hbc.Datagram("t", "n1", 3, (), hbc.KIND_PING))
    assert hbc.PING_MARK in ping and hbc.decode(ping, "t").kind == hbc.KIND_PING
    old = b'{"v":1,"tok":"t","node":"n1","seq":1,"ranks":[[0,5,10,-1]]}'
    assert hbc.decode(old, "t").kind == hbc.KIND_BEATS and b"kind" not in hbc.encode(hbc.decode(old, "t"))
    with pytest.raises(hbc.BadDatagram):
        hbc.decode(b'{"v":1,"tok":"t","node":"n1","seq":1,"ranks":[],"kind":"beacon"}', "t")
    b = hbc.decode_beacon(hbc.encode_beacon("t", 3, 4000), "t")
    assert (b.seq, b.lost_ms) == (3, 4000)
    for bad in (hbc.encode_beacon("other", 3, 4000), b"[[[[", b'{"v":2,"tok":"t","kind":"beacon"}',
                hbc.encode_beacon("t", 3, 0)):
        with pytest.raises(hbc.BadDatagram):
            hbc.decode_beacon(bad, "t")


def test_the_receiver_answers_a_ping_and_the_whole_node_hears_it(setup, tmp_path):
    rx, addr, att = setup(lost_s=2.5)
    slurm = slurm_with()
    a, _ = watch(addr, att, tmp_path, 1, "node2", slurm)
    b, _ = watch(addr, att, tmp_path, 2, "node2", slurm, start=False)   # a neighbour: no thread
    try:
        wait_for(lambda: a.heard() is not None)
        assert a.lost_s == 2.5 and rx.beacons >= 1
        assert rx.received == a.sender.sent + b.sender.sent                   # a ping is no beat
        # Through the node file, which the rank that heard writes just after (under load the
        # read can come between the two).
        wait_for(lambda: b.heard() is not None)
        assert b.lost_s == 2.5
        # An answered exit costs no wait and asks nothing of Slurm.
        t0 = time.monotonic()
        a.at_exit()
        assert time.monotonic() - t0 < 1.0 and a.took_over is None and slurm.calls == []
    finally:
        a.close()
        b.close()


def test_batch_host_lost_one_rank_requeues_once_and_says_so(setup, tmp_path):
    rx, addr, att = setup(lost_s=1.0)
    slurm = slurm_with(**DOWN)
    ws = [watch(addr, att, tmp_path, r, f"node{r + 1}", slurm)[0] for r in (1, 2)]
    try:
        wait_for(lambda: all(w.heard() is not None for w in ws))
        rx.close()                                    # the batch host is gone
        time.sleep(0.3)                               # beacons still on their way arrive
        threads = [threading.Thread(target=w.at_exit) for w in ws]   # both ranks die of it
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert [c for c in slurm.calls if c[0] == "requeue"] == [("requeue", "77")]
        assert [w.took_over for w in ws] == [True, False]                   # the lowest rank
        recs = tl.read(att.parent)
        assert [r["event"] for r in recs] == ["supervisor_lost", "takeover"]
        assert recs[0]["batch_host"] == "node1" and recs[0]["silent_s"] >= 1.0 and recs[1]["asked"]
        assert (att / wd.TAKEOVER_FILE).exists()
    finally:
        for w in ws:
            w.close()


def test_a_job_already_requeued_is_not_requeued_again(setup, tmp_path):
    rx, addr, att = setup(lost_s=1.0)
    slurm = slurm_with(state="PENDING", restarts=1, **DOWN)
    w, _ = watch(addr, att, tmp_path, 1, "node2", slurm)
    try:
        wait_for(lambda: w.heard() is not None)
        rx.close()
        time.sleep(0.3)
        w.at_exit()
        assert not [c for c in slurm.calls if c[0] == "requeue"] and w.took_over is False
        assert tl.read(att.parent)[-1]["asked"] is False
    finally:
        w.close()


def test_a_slow_supervisor_is_not_taken_for_gone(setup, tmp_path):
    """Answers 0.8 s late (a loaded batch host) against a 1.5 s silence: no takeover."""
    rx, addr, att = setup(lost_s=1.5)
    real = rx.answer

    def late(data, src):
        time.sleep(0.8)
        return real(data, src)

    rx.answer = late
    slurm = slurm_with()
    w, lost = watch(addr, att, tmp_path, 1, "node2", slurm)
    try:
        wait_for(lambda: w.heard() is not None)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:           # training goes on, beating; the watch listens
            w.sender.beat(6)
            time.sleep(0.1)
        w.at_exit()
        assert w.took_over is None and lost == [] and not [c for c in slurm.calls if c[0] == "requeue"]
    finally:
        w.close()


def test_silent_while_training_progresses_waits_for_slurms_word(setup, tmp_path, monkeypatch):
    monkeypatch.setattr(wd, "CONFIRM_EVERY_S", 0.2)
    rx, addr, att = setup(lost_s=1.0)
    slurm = slurm_with()                           # Slurm: the batch host is fine
    w, lost = watch(addr, att, tmp_path, 1, "node2", slurm)
    try:
        wait_for(lambda: w.heard() is not None)
        rx.close()                                 # beacons stop (a blocked port, say)
        for _ in range(25):
            w.sender.beat(7)                       # but this rank still makes progress
            time.sleep(0.1)
        assert lost == [] and w.took_over is None and ("job", "77") in slurm.calls
        slurm.node_infos[0] = NodeInfo("node1", "down", frozenset({"NOT_RESPONDING"}))
        for _ in range(10):
            w.sender.beat(8)
            time.sleep(0.1)
        assert lost == [wd.STOP_REASON] and w.confirmed and w.took_over is None
        w.at_exit()                                # the script saved and leaves: now requeue
        assert [c for c in slurm.calls if c[0] == "requeue"] == [("requeue", "77")]
    finally:
        w.close()


def test_silence_and_no_progress_take_over_from_the_thread_once_slurm_says_gone(setup, tmp_path, monkeypatch):
    """Issue 32 (a): a network pause long enough that the collectives stall too (no beacon
    and no progress for lost_s) is no loss while Slurm says the batch host is fine; a rank
    hung in a collective with the lost node's peer never reaches its exit, so once Slurm
    says the host is down its thread takes over."""
    monkeypatch.setattr(wd, "CONFIRM_EVERY_S", 0.2)
    rx, addr, att = setup(lost_s=1.0)
    slurm = slurm_with()                           # Slurm: the batch host is fine
    w, lost = watch(addr, att, tmp_path, 1, "node2", slurm)
    try:
        wait_for(lambda: w.heard() is not None)
        rx.close()                                 # beacons stop, and this rank makes no progress
        time.sleep(2.5)
        assert w.took_over is None and lost == [] and not [c for c in slurm.calls if c[0] == "requeue"]
        asked = [c for c in slurm.calls if c == ("job", "77")]
        assert asked and len(asked) <= 2.5 / 0.2 + 1          # asked, once per interval at most
        slurm.node_infos[0] = NodeInfo("node1", "down", frozenset({"NOT_RESPONDING"}))
        wait_for(lambda: w.took_over is not None, 8)
        assert w.took_over and [c for c in slurm.calls if c[0] == "requeue"] == [("requeue", "77")]
        assert lost == [wd.STOP_REASON]
    finally:
        w.close()


def test_an_exit_after_a_relaunch_is_no_fault(setup, tmp_path):
    """Issue 32 (b): the supervisor relaunched the training in the allocation (it makes
    attempt-1, then closes attempt-0's channel); a rank of attempt-0 exiting late hears no
    answer, and that is not a fault: nothing is asked of Slurm, nothing requeued."""
    rx, addr, att = setup(lost_s=1.0)
    slurm = slurm_with()
    w, lost = watch(addr, att, tmp_path, 1, "node2", slurm)
    try:
        wait_for(lambda: w.heard() is not None)
        (att.parent / "attempt-1" / "heartbeat").mkdir(parents=True)
        rx.close()                                 # the old attempt's channel, closed by the relaunch
        time.sleep(1.3)                            # silent past lost_s: the thread retires
        w.at_exit()
        assert w.took_over is None and slurm.calls == [] and lost == []
        assert w.retired
        assert not (att / wd.TAKEOVER_FILE).exists() and not tl.timeline_path(att.parent).exists()
    finally:
        w.close()


@pytest.mark.parametrize("world", ["host up", "slurm times out"])
def test_no_answer_at_exit_without_slurms_word_does_nothing(setup, tmp_path, monkeypatch, world):
    """No answer at exit only asks Slurm: a host Slurm says is up, or a read that times out
    (every time), is no loss: the rank leaves without a takeover."""
    monkeypatch.setattr(wd, "CONFIRM_EVERY_S", 0.2)
    monkeypatch.setattr(wd, "EXIT_CONFIRM_S", 0.7, raising=False)
    monkeypatch.setattr(wd, "EXIT_CONFIRM_MAX_S", 1.2, raising=False)   # the fake has no SlurmdTimeout
    rx, addr, att = setup(lost_s=1.0)
    if world == "host up":
        slurm = slurm_with()
    else:
        slurm = slurm_with(cls=FlakySlurm, slurm_kw={"when": lambda what: what == "job"}, **DOWN)
    w, lost = watch(addr, att, tmp_path, 1, "node2", slurm, start=False)
    try:
        w.tick()
        wait_for(lambda: (w.tick(), w.heard())[1] is not None)
        rx.close()
        w.at_exit()
        assert ("job", "77") in slurm.calls and not [c for c in slurm.calls if c[0] == "requeue"]
        assert w.took_over is None and not w.confirmed and not (att / wd.TAKEOVER_FILE).exists()
        if world == "slurm times out":
            assert len(slurm.failed) >= 2         # asked again in the next interval, never "gone"
    finally:
        w.close()


def test_a_takeover_whose_read_times_out_is_retried_and_the_others_wait(setup, tmp_path):
    """Issue 32 (c): the batch host really gone, and slurmctld times out once on the
    takeover's read. The owner retries after a backoff pause and requeues; another rank
    that looks at the marker meanwhile (``retrying``) does not give up, and once the
    requeue is asked it leaves it at that: one requeue."""
    rx, addr, att = setup(lost_s=1.0)
    marker = att / wd.TAKEOVER_FILE
    s1 = slurm_with(cls=FlakySlurm, slurm_kw={"when": lambda what: what == "job" and marker.exists()
                                               and not s1.failed}, **DOWN)
    s2 = slurm_with(**DOWN)
    # No threads: the exits drive the watch, so the order of the reads is the test's.
    w1, _ = watch(addr, att, tmp_path, 1, "node2", s1, start=False)
    w2, _ = watch(addr, att, tmp_path, 2, "node3", s2, start=False)
    seen = []

    def sleep1(seconds):                           # rank 1's pauses; no real time passes
        doc = wd.read_marker(marker)
        if doc and doc["state"] == wd.Takeover.RETRYING.value:
            seen.append((seconds, w2.take_over("the batch host node1 is down"), w2.took_over))

    w1.sleep = sleep1
    try:
        wait_for(lambda: [w.tick() for w in (w1, w2)] and w1.heard() is not None and w2.heard() is not None)
        rx.close()
        time.sleep(0.3)
        w1.at_exit()
        assert s1.failed == [("job", 2)]           # the confirmation read, then the takeover's
        assert seen == [(wd.TAKEOVER_BACKOFF_S, None, None)]    # retrying: rank 2 waits
        assert w1.took_over is True and wd.read_marker(marker)["state"] == wd.Takeover.ASKED.value
        w2.at_exit()
        assert w2.took_over is False
        requeues = [c for c in s1.calls + s2.calls if c[0] == "requeue"]
        assert requeues == [("requeue", "77")]
        recs = tl.read(att.parent)
        assert [r["event"] for r in recs] == ["takeover", "supervisor_lost", "takeover"]
        assert recs[0]["asked"] is False and recs[0]["retry_in_s"] == wd.TAKEOVER_BACKOFF_S
        assert "timed out" in recs[0]["why"] and recs[2]["asked"] and recs[2]["try"] == 1
    finally:
        w1.close()
        w2.close()


def test_one_rank_per_node_asks_slurm(tmp_path):
    """Issue 32 (d): beacons lost (a rack's management network) with training going on:
    per confirmation interval one rank of each node asks slurmctld, and the node's other
    ranks read its answer from the node-local word file (private, as the beats are)."""
    import os
    import socket
    import stat

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))                       # takes the pings, answers nothing
    addr = f"127.0.0.1:{s.getsockname()[1]}/tok1"
    att = tmp_path / "job" / "attempt-0"
    (att / "heartbeat").mkdir(parents=True)
    now = [1000.0]
    clock = lambda: now[0]                         # noqa: E731
    slurm = slurm_with()                           # the batch host is fine: the network is not
    ws = []
    for rank in range(1, 7):
        node = "node2" if rank <= 3 else "node3"
        sender = hbc.NodeSender(addr, str(att / "heartbeat"), rank, node=node, root=str(tmp_path / "shm"),
                                interval_s=0.2, clock=clock)
        sender.beat(1)
        ws.append(wd.Watchdog(sender, rank=rank, job_id="77", incarnation=0, slurm_factory=lambda: slurm,
                              clock=clock, start=False))
    try:
        from clusterops import protocol

        for node_dir in {w.sender.local for w in ws}:     # the last beacon each node heard
            protocol.write_private(os.path.join(node_dir, wd.BEACON_FILE), b"1000.0 1000\n")
        rounds = 4
        for k in range(rounds):
            now[0] += wd.CONFIRM_EVERY_S
            for w in ws:
                w.sender.beat(2 + k)               # progress: only Slurm can say the host is gone
                w.tick()
        assert len([c for c in slurm.calls if c == ("job", "77")]) == 2 * rounds     # 2 nodes, not 6 ranks
        assert sum(w.asks for w in ws) == 2 * rounds and all(w.took_over is None for w in ws)
        for w in ws:
            local = w.sender.local
            assert stat.S_IMODE(os.lstat(local).st_mode) == 0o700
            assert stat.S_IMODE(os.lstat(w.word_path).st_mode) == 0o600
            asks = [n for n in os.listdir(local) if n.startswith(wd.ASK_PREFIX)]
            assert asks and all(stat.S_IMODE(os.lstat(os.path.join(local, n)).st_mode) == 0o600 for n in asks)
    finally:
        for w in ws:
            w.close()
        s.close()


def test_what_slurm_says_of_the_batch_host():
    host = job()
    assert wd.host_verdict(host, NodeInfo("node1", "allocated")) == ""
    assert wd.host_verdict(host, NodeInfo("node1", "mixed", frozenset({"DRAIN"}))) == ""
    assert "down" in wd.host_verdict(host, NodeInfo("node1", "down"))
    assert "NOT_RESPONDING" in wd.host_verdict(host, NodeInfo("node1", "allocated", frozenset({"NOT_RESPONDING"})))
    assert "POWERED_DOWN" in wd.host_verdict(host, NodeInfo("node1", "idle", frozenset({"POWERED_DOWN"})))
    assert "no longer in the job" in wd.host_verdict(job(nodes=("node2", "node3")), None)
    assert wd.host_verdict(host, None) == ""


def test_the_takeover_marker_states():
    T = wd.Takeover
    assert wd.marker_says(None, 10.0) == "claim"
    for state in (T.CLAIMED, T.RETRYING):
        assert wd.marker_says({"state": state.value, "until": 20.0}, 10.0) == "wait"
        assert wd.marker_says({"state": state.value, "until": 5.0}, 10.0) == "claim"    # the lease passed
    assert wd.marker_says({"state": T.RELEASED.value, "until": 20.0}, 10.0) == "claim"
    for state in (T.ASKED, T.NOT_NEEDED):
        assert wd.marker_says({"state": state.value, "until": 5.0}, 10.0) == "done"


def test_a_rank_that_never_heard_a_beacon_never_takes_over(tmp_path):
    """An older supervisor (no beacons): the watch stays quiet, at exit too."""
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))                       # takes the pings, answers nothing
    att = tmp_path / "job" / "attempt-0"
    (att / "heartbeat").mkdir(parents=True)
    slurm = slurm_with()
    w, lost = watch(f"127.0.0.1:{s.getsockname()[1]}/tok1", att, tmp_path, 1, "node2", slurm)
    try:
        time.sleep(0.6)
        w.at_exit()
        assert w.heard() is None and w.took_over is None and slurm.calls == [] and lost == []
    finally:
        w.close()
        s.close()


def test_lost_setting_is_checked():
    assert ch.lost_from_env({}) == ch.LOST_DEFAULT_S
    assert ch.lost_from_env({ch.LOST_ENV: "4"}) == 4.0
    for bad in ("0", "x", "-3", "1e9"):
        with pytest.raises(Exception, match=ch.LOST_ENV):
            ch.lost_from_env({ch.LOST_ENV: bad})


def test_a_requeue_that_kills_its_asker_still_counts(setup, tmp_path):
    """Slurm's first answer to the requeue is SIGTERM to the job's processes, scontrol
    included: the exit of scontrol by a signal is checked against the job's state."""
    from clusterops.slurm.api import SlurmError

    rx, addr, att = setup(lost_s=1.0)

    class Killed(FakeSlurm):
        def requeue(self, job_id, *, hold=False):
            super().requeue(job_id)
            self.job_infos = [job(state="REQUEUED", restarts=1)]
            raise SlurmError("scontrol requeue 77 exited with -15")

    slurm = Killed(nodes=[NodeInfo("node1", "down", frozenset({"NOT_RESPONDING"}))], jobs=[job()])
    w, _ = watch(addr, att, tmp_path, 1, "node2", slurm)
    try:
        wait_for(lambda: w.heard() is not None)
        rx.close()
        time.sleep(0.3)
        w.at_exit()
        assert w.took_over is True
        assert [r.get("asked") for r in tl.read(att.parent) if r["event"] == "takeover"] == [True]
    finally:
        w.close()


class SlurmSeesItLate(FakeSlurm):
    """The batch host "up" for the first reads after a power cut, then NOT_RESPONDING, as Slurm
    sees a lost node only after SlurmdTimeout (the dev cluster's CI run that found this)."""

    def __init__(self, *a, up_reads=2, slurmd_timeout=3, **kw):
        super().__init__(*a, **kw)
        self.up_reads, self.timeout = up_reads, slurmd_timeout

    def show_config(self) -> str:
        return f"SlurmctldTimeout        = 120 sec\nSlurmdTimeout           = {self.timeout} sec\n"

    def node(self, name):
        n = super().node(name)
        if name == "node1":
            self.up_reads -= 1
            if self.up_reads < 0:
                return NodeInfo("node1", "down", frozenset({"NOT_RESPONDING"}))
        return n


def test_an_exiting_rank_waits_for_slurm_to_see_the_host_go_then_takes_over(setup, tmp_path, monkeypatch):
    """A rank whose collective failed with the batch host (a power cut) exits before Slurm has
    marked the host down: it keeps asking (once per node and interval) until Slurm says gone,
    within SlurmdTimeout and two intervals, and then requeues the job."""
    monkeypatch.setattr(wd, "CONFIRM_EVERY_S", 0.3)
    rx, addr, att = setup(lost_s=1.0)
    slurm = slurm_with(cls=SlurmSeesItLate)
    w, _ = watch(addr, att, tmp_path, 1, "node2", slurm, start=False)
    try:
        w.tick()
        wait_for(lambda: (w.tick(), w.heard())[1] is not None)
        rx.close()
        w.at_exit()
        assert w.confirmed and w.took_over is True, slurm.calls
        assert [c for c in slurm.calls if c[0] == "requeue"] == [("requeue", "77")]
    finally:
        w.close()
