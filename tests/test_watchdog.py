"""The ranks' watch on their supervisor (clusterops.watchdog) against the real receiver.

Real UDP sockets, the real node-local directories and the real receiver thread of
clusterops.supervisor.channel; only Slurm is the recorded fake (its job and node reads).
The batch host's loss is the receiver closed; a slow supervisor is a receiver whose
answers come late.
"""

from __future__ import annotations

import threading
import time

import pytest

from support.fakes import FakeSlurm
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


def slurm_with(host_state="allocated", **kw):
    return FakeSlurm(nodes=[NodeInfo("node1", host_state), NodeInfo("node2", "allocated")], jobs=[job(**kw)])


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
    slurm = slurm_with()
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
    slurm = slurm_with(state="PENDING", restarts=1)
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


def test_silence_and_no_progress_take_over_from_the_thread(setup, tmp_path):
    """A rank hung in a collective with the lost node's peer never reaches its exit."""
    rx, addr, att = setup(lost_s=1.0)
    slurm = slurm_with()
    w, _ = watch(addr, att, tmp_path, 1, "node2", slurm)
    try:
        wait_for(lambda: w.heard() is not None)
        rx.close()
        wait_for(lambda: w.took_over is not None, 8)
        assert w.took_over and [c for c in slurm.calls if c[0] == "requeue"] == [("requeue", "77")]
    finally:
        w.close()


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

    slurm = Killed(nodes=[NodeInfo("node1", "allocated")], jobs=[job()])
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
