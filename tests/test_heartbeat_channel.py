"""The node heartbeat channel: the datagram codec, the sender's node-local aggregation, the
UDP receiver (real sockets on 127.0.0.1), the file fallback, and SupervisorRun detecting
a silent rank by rank and node through it (the fakes of test_supervisor_run_fast)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import pytest

import test_supervisor_run_fast as fast
from test_supervisor_run_fast import world  # noqa: F401 (the fixture)
from clusterops import heartbeat as hbc
from clusterops import protocol
from clusterops import supervisor as sv
from clusterops.errors import InputError
from clusterops.supervisor import channel as ch


def wait_for(cond, timeout_s=5.0):
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


# ------------------------------------------------------------------------------ codec
def test_codec_round_trip_and_size():
    d = hbc.Datagram("tok", "n17", 42, tuple(hbc.RankBeat(r, 1000 + r, 5 * r, 812) for r in range(8)))
    data = hbc.encode(d)
    assert hbc.decode(data) == d
    assert len(data) < 300            # one small datagram per node: 8 ranks
    assert json.loads(data)["v"] == hbc.VERSION


@pytest.mark.parametrize("data, why", [
    (b"{torn", "not JSON"),
    (b"[1]", "not a JSON object"),
    (json.dumps({"v": 2, "tok": "", "node": "n", "seq": 1, "ranks": []}).encode(), "version 2"),
    (json.dumps({"v": 1, "tok": "", "node": "", "seq": 1, "ranks": []}).encode(), "strings"),
    (json.dumps({"v": 1, "tok": "", "node": "n", "seq": "1", "ranks": []}).encode(), "seq"),
    (json.dumps({"v": 1, "tok": "", "node": "n", "seq": 1, "ranks": [[1, 2, 3]]}).encode(), "rank entry"),
    (json.dumps({"v": 1, "tok": "", "node": "n", "seq": 1, "ranks": [[1, 2, True, 4]]}).encode(), "rank entry"),
    (json.dumps({"v": 1, "tok": "", "node": "n", "seq": 1, "ranks": [[-1, 2, 3, 4]]}).encode(), "negative"),
    (b" " * (hbc.MAX_DATAGRAM + 1), "more than"),
])
def test_codec_rejects_what_is_not_a_datagram(data, why):
    with pytest.raises(hbc.BadDatagram, match=why):
        hbc.decode(data)


def test_parse_addr():
    assert hbc.parse_addr("10.0.0.1:5000/abc") == ("10.0.0.1", 5000, "abc")
    assert hbc.parse_addr("[::1]:7/t") == ("::1", 7, "t")
    for bad in ("10.0.0.1/abc", "host:x/t", "host:0/t", ":5/t", "file"):
        with pytest.raises(ValueError):
            hbc.parse_addr(bad)


def test_mode_from_env():
    assert ch.mode_from_env({}) == "net"
    assert ch.mode_from_env({ch.MODE_ENV: "file"}) == "file"
    with pytest.raises(InputError, match=ch.MODE_ENV):
        ch.mode_from_env({ch.MODE_ENV: "carrier-pigeon"})


# ------------------------------------------------------------------------------ sender + receiver
class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_one_datagram_per_node_and_interval_carries_every_local_rank(tmp_path):
    clock = Clock(1000.2)
    c = ch.Channel("net", tmp_path / "hb", clock=clock)
    try:
        senders = [hbc.NodeSender(c.env_value, str(tmp_path / "hb"), r, node="n1", root=str(tmp_path / "shm"),
                                  clock=clock) for r in range(4)]
        won = [s.beat(10) for s in senders]
        assert won == [True, False, False, False]      # rank 0 won the interval, alone sent
        wait_for(lambda: c.receiver.received == 1)     # received at the (fake) time it was sent
        clock.t = 1001.5                               # next interval: 1.3 s later, steps 10 -> 12
        won = [s.beat(12) for s in senders[1:]]         # rank 0 went silent
        assert won == [True, False, False]
        wait_for(lambda: c.receiver.received == 2)
        # Ranks that beat after their node's send of an interval go out with the next one.
        assert {r: b[0] for r, b in c.snapshot(expected_ranks=4).items()} == {0: 10, 1: 12, 2: 10, 3: 10}
        clock.t = 1002.6
        assert senders[2].beat(14)
        wait_for(lambda: c.receiver.received == 3)
        beats = c.snapshot(expected_ranks=4)
        assert {r: b[0] for r, b in beats.items()} == {0: 10, 1: 12, 2: 14, 3: 12}
        assert beats[0][1] == pytest.approx(1000.2, abs=0.01)   # rank 0's progress time, not the send's
        assert beats[3][1] == pytest.approx(1001.5, abs=0.01)
        assert c.step_times_ms() == {1: 650, 2: 550, 3: 650}
        assert c.file_scans == 0 and not (tmp_path / "hb").exists()   # no shared-filesystem op
        # Node-local state only: the rank files and at most two recent slots.
        local = Path(senders[0].local)
        assert sorted(p.name for p in local.iterdir())[:4] == ["rank0", "rank1", "rank2", "rank3"]
    finally:
        c.close()


def test_receiver_drops_foreign_and_bad_datagrams(tmp_path):
    r = ch.Receiver("good").start()
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for tok in ("bad", "good"):
            s.sendto(hbc.encode(hbc.Datagram(tok, "n1", 1, (hbc.RankBeat(3, 7, 0, -1),))), ("127.0.0.1", r.port))
        s.sendto(b"\x00garbage", ("127.0.0.1", r.port))
        wait_for(lambda: r.received + r.dropped == 3)
        assert (r.received, r.dropped) == (1, 2)
        assert r.snapshot()[3][0] == 7 and list(r.nodes) == ["n1"]
    finally:
        r.close()


def test_an_older_report_never_moves_a_rank_back(tmp_path):
    r = ch.Receiver("t")
    r.sock.close()
    r.feed(hbc.encode(hbc.Datagram("t", "n1", 2, (hbc.RankBeat(0, 9, 0, -1),))), now=100.0)
    r.feed(hbc.encode(hbc.Datagram("t", "n1", 1, (hbc.RankBeat(0, 8, 5000, -1),))), now=100.5)
    step, t, _, heard = r.snapshot()[0]
    assert (step, t, heard) == (9, 100.0, 100.5)


def test_file_fallback_when_the_network_path_fails(tmp_path):
    """A sender that cannot send writes its node's file; a node not heard on the network
    is read from it, and only then is the directory scanned."""
    hb = tmp_path / "hb"
    hb.mkdir()
    clock = Clock(2000.0)
    c = ch.Channel("net", hb, clock=clock)
    try:
        good = hbc.NodeSender(c.env_value, str(hb), 0, node="n1", root=str(tmp_path / "shm"), clock=clock)
        # n2's ranks got an address they cannot send to (port 0 refuses every sendto).
        cut = hbc.NodeSender(f"127.0.0.1:9/{c.receiver.token}", str(hb), 1, node="n2",
                             root=str(tmp_path / "shm"), clock=clock)
        cut.dest = ("127.0.0.1", 0)
        assert good.beat(5) and cut.beat(6)
        assert (good.sent, good.file_writes, cut.sent, cut.file_writes) == (1, 0, 0, 1)
        assert [p.name for p in hb.iterdir()] == [f"{protocol.NODE_HEARTBEAT_PREFIX}n2"]
        wait_for(lambda: c.receiver.received == 1)
        assert {r: b[0] for r, b in c.snapshot(expected_ranks=2).items()} == {0: 5, 1: 6}
        assert c.file_scans == 1
        # Every rank heard on the network: no scan.
        c.receiver.feed(hbc.encode(hbc.Datagram(c.receiver.token, "n2", 9, (hbc.RankBeat(1, 7, 0, -1),))), 2000.0)
        assert c.snapshot(expected_ranks=2)[1][0] == 7 and c.file_scans == 1
    finally:
        c.close()


def test_forced_file_mode_writes_one_file_per_node(tmp_path):
    hb = tmp_path / "hb"
    hb.mkdir()
    clock = Clock(3000.0)
    c = ch.Channel("file", hb, clock=clock)
    assert protocol.is_file_addr(c.env_value) and c.receiver is None
    senders = [hbc.NodeSender(c.env_value, str(hb), r, node=f"n{r // 8}", root=str(tmp_path / "shm"), clock=clock)
               for r in range(32)]
    for s in senders:
        s.beat(3)
    assert sorted(p.name for p in hb.iterdir()) == [f"node-n{i}" for i in range(4)]
    assert sum(s.file_writes for s in senders) == 4
    clock.t += 1.0
    for s in senders:
        s.beat(4)
    assert sum(s.file_writes for s in senders) == 8        # one per node and interval
    beats = c.snapshot(expected_ranks=32)
    # The sender of each node sends before its neighbours beat: they show the last interval.
    assert {r: b[0] for r, b in beats.items()} == {r: 4 if r % 8 == 0 else 3 for r in range(32)}


# ------------------------------------------------------------------------------ SupervisorRun
class ChannelStep(fast.FakeStep):
    """The simulated ranks of the fast tests, beating through the node channel."""

    def __init__(self, world, argv, log_path, env):
        super().__init__(world, argv, log_path, env)
        addr = env[protocol.ENV_HEARTBEAT_ADDR]
        ppn = self.ranks // len(self.nodes)
        self.senders = {r: hbc.NodeSender(addr, str(self.hb_dir), r, node=self.nodes[r // ppn],
                                          root=str(world.shm), clock=world.clock) for r in range(self.ranks)}

    def tick(self, now):
        w = self.world
        if self.returncode is not None:
            return
        if self.usr2 or self.stop_file.exists():
            step = min(self.steps.values())
            w.commit(step)
            return self._exit(0, f"0: stopped step={step}\n")
        for r in range(self.ranks):
            if r in self.frozen:
                continue
            self.steps[r] += 1
            if self.senders[r].beat(self.steps[r]) and self.senders[r].file_writes:
                f = self.hb_dir / f"{protocol.NODE_HEARTBEAT_PREFIX}{self.senders[r].node}"
                os.utime(f, (now, now))     # the file's mtime on the fake clock
        rx = w.run.channel.receiver
        if rx is not None:      # the receiver thread has every datagram before the next poll
            sent = sum(s.sent for s in self.senders.values())  # (unless a test ended the thread)
            wait_for(lambda: rx.received >= sent or not rx._thread.is_alive())
        step = min(self.steps.values())
        if step % w.ckpt_every == 0 and not self.frozen:
            w.commit(step)
        w.fault(self, now, step)


def channel_world(world, tmp_path, monkeypatch, mode="net"):
    """The fast tests' world with its training steps replaced by ChannelSteps (ranks beating
    through the node channel in ``mode``) and the batch host on 127.0.0.1."""
    monkeypatch.setenv(ch.MODE_ENV, mode)
    world.shm = tmp_path / "shm"
    world.slurm.node_address = lambda name: "127.0.0.1"   # the batch host: the receiver is here
    spawn = world.runner.spawn

    def spawn_channel_step(argv, *, log_path, env=None, cwd=None, unset=()):
        proc = spawn(argv, log_path=log_path, env=env, cwd=cwd, unset=unset)
        if isinstance(proc, fast.FakeStep):
            proc = world.step = ChannelStep(world, argv, log_path, env)
        return proc
    world.runner.spawn = spawn_channel_step


@pytest.mark.parametrize("mode", ["net", "file"])
def test_supervisor_names_the_silent_rank_and_its_node(world, tmp_path, monkeypatch, mode):
    channel_world(world, tmp_path, monkeypatch, mode)
    seen = {}

    def hang(proc, now, step):
        if proc.attempt != 0:
            if step >= 30:
                proc._exit(0, "0: done\n")
            return
        if step == 15 and 3 not in proc.frozen:
            proc.frozen[3] = now            # rank 3 (on n2) stops
            seen["files"] = sorted(p.name for p in proc.hb_dir.iterdir())
        if 3 in proc.frozen and now - proc.frozen[3] >= 8:
            for r in (0, 1, 2):             # the others block in the next collective
                proc.frozen.setdefault(r, now)
    world.fault = hang
    run = fast.make_run(world, tmp_path, preflight=None, ranks_per_node=2)
    world.run = run
    assert run.cfg.heartbeat == mode
    assert run.run() == sv.EXIT_DONE
    lost = fast.events(tmp_path, "heartbeat_lost")[0]
    assert lost["culprits"] == [3] and 3 in lost["ranks"] and "n2" in lost["nodes"]
    exit0 = fast.events(tmp_path, "step_exit")[0]
    assert exit0["cause"] == "hang" and exit0["blamed"] == ["n2"]
    env0 = fast.train_spawns(world)[0]["env"]
    if mode == "net":
        host, port, token = hbc.parse_addr(env0[protocol.ENV_HEARTBEAT_ADDR])
        assert host == "127.0.0.1" and token
        assert seen["files"] == []          # steady state: nothing on the job directory
    else:
        assert protocol.is_file_addr(env0[protocol.ENV_HEARTBEAT_ADDR])
        assert seen["files"] == ["node-n1", "node-n2"]


def test_file_mode_attempts_never_read_each_others_node_local_beats(tmp_path):
    # Two attempts (or two jobs) with the same heartbeat directory path on the same node:
    # the second must not report the first one's leftover beats as its own progress.
    hb = tmp_path / "hb"
    hb.mkdir()
    shm = str(tmp_path / "shm")
    clock = Clock(3000.0)
    first = ch.Channel("file", hb, clock=clock)
    hbc.NodeSender(first.env_value, str(hb), 0, node="n0", root=shm, clock=clock).beat(40)
    second = ch.Channel("file", hb, clock=clock)
    assert first.env_value != second.env_value
    assert protocol.is_file_addr(second.env_value) and not protocol.is_file_addr("127.0.0.1:5/x")
    s1 = hbc.NodeSender(second.env_value, str(hb), 1, node="n0", root=shm, clock=clock)
    assert [b.rank for b in s1.collect(clock())] == []
    s1.beat(2)
    assert [(b.rank, b.step) for b in s1.collect(clock())] == [(1, 2)]
    assert hbc.read_local_steps(second.env_value, str(hb), shm) == {1: 2}
    assert hbc.read_local_steps(first.env_value, str(hb), shm) == {0: 40}


def test_a_new_sender_removes_node_local_beats_nobody_wrote_for_an_hour(tmp_path):
    import os
    import time

    shm = tmp_path / "shm"
    now = time.time()
    old = shm / f"{hbc.LOCAL_PREFIX}old" / "n0"
    recent = shm / f"{hbc.LOCAL_PREFIX}recent" / "n0"
    other = shm / "not-ours"
    for d in (old, recent, other):
        d.mkdir(parents=True)
    (old / "rank0").write_text("5 1.0 -1 -1\n")
    (recent / "rank0").write_text("5 1.0 -1 -1\n")
    stale = now - hbc.STALE_AFTER_S - 60
    for path in (old / "rank0", old, old.parent, other):
        os.utime(path, (stale, stale))
    # the key directory is old but a rank renamed a file in its node directory a minute ago
    os.utime(recent.parent, (stale, stale))
    os.utime(recent, (now - 60, now - 60))
    (tmp_path / "hb").mkdir()
    s = hbc.NodeSender("file/abc", str(tmp_path / "hb"), 0, node="n0", root=str(shm))
    left = sorted(p.name for p in shm.iterdir())
    assert f"{hbc.LOCAL_PREFIX}old" not in left
    assert f"{hbc.LOCAL_PREFIX}recent" in left and "not-ours" in left
    assert os.path.isdir(s.local)
    # a beat recreates its directory if it went away (a job suspended past the limit)
    import shutil

    shutil.rmtree(os.path.dirname(s.local))
    s.beat(1)
    assert hbc.read_local_steps("file/abc", str(tmp_path / "hb"), str(shm)) == {0: 1}


def test_the_receiver_takes_a_burst_of_datagrams_queued_between_its_drains(tmp_path):
    # Thousands of nodes: many datagrams arrive between two wake-ups of the receiver and
    # every one of them is taken (none dropped, none left waiting for the next one).
    r = ch.Receiver("tok").start()
    try:
        out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for n in range(600):
            beats = tuple(hbc.RankBeat(8 * n + i, 5, 0, 100, 40) for i in range(8))
            out.sendto(hbc.encode(hbc.Datagram("tok", f"n{n}", 1, beats)), ("127.0.0.1", r.port))
        out.close()
        wait_for(lambda: r.received == 600, timeout_s=10)
        assert r.dropped == 0 and len(r.snapshot()) == 4800
        assert r.timings()[4799] == (5, 100, 40)
    finally:
        r.close()
