"""What the heartbeat channel trusts, tested against what another local user can do: send
any bytes to the receiver's port (a deeply nested array once killed the receiver thread, and
the healthy job was then killed as hung), read world-readable files (the token must not be
in one), and plant directories or symlinks at the node-local beat path in the shared
``/dev/shm`` (a second real user, tests/support/users.py, does the planting). Also: the
receiver listens on the address the ranks were given, a receiver thread that ended anyway
is restarted by the supervisor, and a corrupt supervisor state file is a one-line error.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from pathlib import Path

import pytest

import test_supervisor_run_fast as fast
from test_heartbeat_channel import Clock, channel_world, wait_for
from test_supervisor_run_fast import world  # noqa: F401 (the fixture)
from clusterops import heartbeat as hbc
from clusterops import protocol
from clusterops import sdk
from clusterops import supervisor as sv
from clusterops.errors import InputError
from clusterops.supervisor import channel as ch
from clusterops.supervisor import run as svrun

DEEP = b"[" * 200_000 + b"]" * 200_000          # json.loads: RecursionError, not ValueError


def good(token: str, rank: int = 0, step: int = 7) -> bytes:
    return hbc.encode(hbc.Datagram(token, "n1", 1, (hbc.RankBeat(rank, step, 0, -1),)))


# ------------------------------------------------------------------------------ datagrams
@pytest.mark.parametrize("data", [
    b"[" * 100_000,
    b'{"v":1,"tok":"t","node":"n","seq":1,"ranks":[[[[[[[[1]]]]]]]]}',
    b'{"v":1,"tok":"t","node":"n","seq":1,"ranks":[],"x":' + b"{\"a\":" * 50_000 + b"1" + b"}" * 50_000 + b"}",
    b'{"v":1,"tok":"t","node":"n","seq":1,"ranks":[[1,' + b"9" * 5000 + b',0,0]]}',     # int digits limit
    b"\xff\xfe\x00{",
    b'{"v":1,"tok":"t","node":"' + b"n" * 300 + b'","seq":1,"ranks":[]}',
])
def test_decode_raises_only_bad_datagram_whatever_the_bytes(data):
    with pytest.raises(hbc.BadDatagram):
        hbc.decode(data)


@pytest.mark.parametrize("data, deep", [
    (b'{"a":[[1]]}', False), (b'{"a":[[[1]]]}', True), (b"[[[]]]", False), (b"[[[[]]]]", True),
    (b"{[{[]}]}", True), (b"[][][]", False), (b"{torn", False), (b"[[[[", True), (b"[" * 100_000, True),
])
def test_the_nesting_check_before_the_parser(data, deep):
    assert hbc.too_deep(data) is deep


def test_decode_checks_the_token_before_it_parses(monkeypatch):
    parsed = []
    real = json.loads
    monkeypatch.setattr(hbc.json, "loads", lambda data: parsed.append(data) or real(data))
    with pytest.raises(hbc.BadDatagram, match="token"):
        hbc.decode(good("other"), "mine")
    assert parsed == []                                  # never reached the parser
    assert hbc.decode(good("mine"), "mine").ranks[0].step == 7 and len(parsed) == 1
    # The token mark inside another field does not smuggle a foreign token in.
    forged = json.dumps({"v": 1, "tok": "other", "node": "n1", "seq": 1, "ranks": [],
                         "x": '"tok":"mine"'}, separators=(",", ":")).encode()
    with pytest.raises(hbc.BadDatagram, match="token"):
        hbc.decode(forged, "mine")


def test_a_deeply_nested_datagram_does_not_end_the_receiver(tmp_path):
    r = ch.Receiver("good").start()
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"[" * 60_000, ("127.0.0.1", r.port))
        s.sendto(b'{"v":1,"tok":"good","node":"n","seq":1,"ranks":' + b"[" * 20_000, ("127.0.0.1", r.port))
        s.sendto(good("good"), ("127.0.0.1", r.port))
        wait_for(lambda: r.received + r.dropped >= 3 or not r._thread.is_alive())
        assert r._thread.is_alive()
        assert (r.received, r.dropped) == (1, 2)
        assert r.snapshot()[0][0] == 7
        # A feed that raises (a bug) is counted, and the thread goes on.
        real_feed = r.feed
        r.feed = lambda data, now: (_ for _ in ()).throw(RuntimeError("bug")) if data == b"boom" else \
            real_feed(data, now)
        s.sendto(b"boom", ("127.0.0.1", r.port))
        s.sendto(good("good", step=8), ("127.0.0.1", r.port))
        wait_for(lambda: r.received == 2)
        assert r._thread.is_alive() and r.dropped == 3 and r.error == ""
        s.close()
    finally:
        r.close()


def test_the_receiver_listens_on_the_address_the_ranks_were_given(tmp_path):
    c = ch.Channel("net", tmp_path / "hb", advertise_host="127.0.0.1")
    try:
        assert c.receiver.sock.getsockname()[0] == "127.0.0.1" and c.bind_fallback == ""
        assert hbc.parse_addr(c.env_value)[:2] == ("127.0.0.1", c.receiver.port)
    finally:
        c.close()
    # Not this host's address (TEST-NET-1): every interface, and the channel says why.
    c = ch.Channel("net", tmp_path / "hb", advertise_host="192.0.2.1")
    try:
        assert c.receiver.sock.getsockname()[0] == "0.0.0.0"
        assert "192.0.2.1" in c.bind_fallback
        assert hbc.parse_addr(c.env_value)[0] == "192.0.2.1"     # the ranks still send there
    finally:
        c.close()


def test_a_name_is_bound_as_the_address_it_resolves_to_unless_that_is_loopback():
    assert ch.bind_address("127.0.0.1") == ("127.0.0.1", "127.0.0.1", "")
    assert ch.bind_address("[::1]") == ("::1", "::1", "")
    bind, advertise, why = ch.bind_address("localhost")     # other nodes cannot reach it
    assert (bind, advertise) == ("", "localhost") and "loopback" in why
    c = ch.Channel("net", "hb", advertise_host="localhost")
    try:
        assert c.receiver.sock.getsockname()[0] == "0.0.0.0" and "loopback" in c.bind_fallback
        assert hbc.parse_addr(c.env_value)[0] == "localhost"
    finally:
        c.close()


def test_a_receiver_that_ended_is_restarted_on_its_port_and_keeps_its_beats():
    r = ch.Receiver("t").start()
    try:
        r.feed(good("t", rank=3, step=5), 10.0)
        real = r.feed
        r.feed = lambda data, now: (_ for _ in ()).throw(SystemExit("injected")) if data == b"die" else \
            real(data, now)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.sendto(b"die", ("127.0.0.1", r.port))
        wait_for(lambda: not r.alive)
        assert "injected" in r.error
        s.sendto(good("t", rank=4, step=6), ("127.0.0.1", r.port))     # queued meanwhile
        port = r.port
        r.restart()
        wait_for(lambda: r.received == 2)
        assert r.alive and r.port == port and r.restarts == 1 and r.error == ""
        assert {k: v[0] for k, v in r.snapshot().items()} == {3: 5, 4: 6}
        # Its socket gone as well: a new one on the same port.
        r.sock.close()
        r.feed = lambda data, now: (_ for _ in ()).throw(SystemExit("again")) if data == b"die" else \
            real(data, now)
        r._stop.set()
        wait_for(lambda: not r.alive)
        r._stop.clear()
        r.restart()
        assert r.sock.getsockname()[1] == port and r.alive
        s.sendto(good("t", rank=5, step=1), ("127.0.0.1", port))
        wait_for(lambda: r.received == 3)
        s.close()
    finally:
        r.close()


def test_the_supervisor_restarts_a_receiver_that_ended_and_the_job_is_not_hung(world, tmp_path, monkeypatch):
    channel_world(world, tmp_path, monkeypatch)
    crashed = {}

    def crash_once(proc, now, step):
        if step >= 30:
            return proc._exit(0, "0: done step=30\n")
        if step == 12 and not crashed:
            rx = world.run.channel.receiver
            real = rx.feed
            rx.feed = lambda data, t: (_ for _ in ()).throw(SystemExit("injected")) if data == b"die" else \
                real(data, t)
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.sendto(b"die", ("127.0.0.1", rx.port))
            s.close()
            wait_for(lambda: not rx._thread.is_alive())
            crashed["at"] = now
    world.fault = crash_once
    run = fast.make_run(world, tmp_path, preflight=None, ranks_per_node=2, hang_timeout_s=8)
    world.run = run
    assert run.run() == sv.EXIT_DONE
    assert crashed
    assert fast.events(tmp_path, "heartbeat_lost") == []
    assert [e["cause"] for e in fast.events(tmp_path, "step_exit")] == ["finished"]
    again = fast.events(tmp_path, "heartbeat_receiver_restarted")
    assert len(again) == 1 and "injected" in again[0]["error"]


# ------------------------------------------------------------------------------ file modes
def test_the_token_is_only_in_files_of_the_user_alone(world, tmp_path, monkeypatch):
    channel_world(world, tmp_path, monkeypatch, mode="file")
    world.fault = lambda proc, now, step: proc._exit(0, "0: done step=12\n") if step >= 12 else None
    run = fast.make_run(world, tmp_path, preflight=None, ranks_per_node=2)
    world.run = run
    old = os.umask(0o022)
    try:
        assert run.run() == sv.EXIT_DONE
    finally:
        os.umask(old)
    job = tmp_path / "job"
    token = fast.train_spawns(world)[0]["env"][protocol.ENV_HEARTBEAT_ADDR].partition("/")[2]
    assert token
    assert stat.S_IMODE(job.stat().st_mode) == 0o700
    holders = []
    for p in job.rglob("*"):
        mode = stat.S_IMODE(p.lstat().st_mode)
        if p.is_dir():
            if p.name.startswith("attempt-") or p.name == "heartbeat":
                assert mode == 0o700, p
            continue
        if token.encode() in p.read_bytes():
            holders.append(p.relative_to(job).as_posix())
            assert mode == 0o600, (p, oct(mode))
    assert "attempt-0/command.txt" in holders and "attempt-0/heartbeat/node-n1" in holders
    # The node-local beat directories are the user's alone too.
    for p in (tmp_path / "shm").rglob("*"):
        mode = stat.S_IMODE(p.lstat().st_mode)
        assert mode == (0o700 if p.is_dir() else 0o600), (p, oct(mode))


def test_a_job_directory_is_made_with_the_mode_asked_for(tmp_path):
    svrun.make_job_dir(tmp_path / "a" / "job")
    assert stat.S_IMODE((tmp_path / "a" / "job").stat().st_mode) == 0o700
    svrun.make_job_dir(tmp_path / "b", 0o750)
    assert stat.S_IMODE((tmp_path / "b").stat().st_mode) == 0o750
    (tmp_path / "c").mkdir(mode=0o755)
    svrun.make_job_dir(tmp_path / "c")                 # one that exists is left alone
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o755


# ------------------------------------------------------------------------------ another user
@pytest.fixture
def other_user():
    from support.users import ensure_user

    return ensure_user()


def as_user(pw, fn) -> None:
    """Run ``fn()`` in a child process with the other user's uid and gid (real, no root left)."""
    pid = os.fork()
    if pid == 0:       # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(pw.pw_gid)
            os.setuid(pw.pw_uid)
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.fixture
def shm():
    """A shared node-local root like /dev/shm: world-writable, sticky, under /tmp where the
    other user can reach it (pytest's tmp_path is under root's private directory)."""
    import shutil

    d = tempfile.mkdtemp(prefix="clusterops-shm-")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _beat_through_sdk(monkeypatch, shm, hb, addr, step=5):
    monkeypatch.setattr(hbc, "local_root", lambda: shm)
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_DIR, str(hb))
    monkeypatch.setenv(protocol.ENV_HEARTBEAT_ADDR, addr)
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("RANK", "0")
    sdk._reset()
    try:
        return sdk.heartbeat(step, force=True)
    finally:
        sdk._reset()


@pytest.mark.parametrize("plant", ["directory", "symlink"])
def test_a_path_planted_by_another_user_neither_redirects_a_write_nor_injects_a_rank(
        tmp_path, monkeypatch, other_user, shm, plant):
    hb = tmp_path / "hb"
    hb.mkdir()
    c = ch.Channel("net", hb, advertise_host="127.0.0.1")
    try:
        key_dir = os.path.dirname(hbc.local_dir(c.env_value, str(hb), "n1", shm))
        theirs = os.path.join(shm, "theirs")

        def planting():
            os.mkdir(theirs, 0o777)
            os.chmod(theirs, 0o777)
            if plant == "symlink":      # the beats would land in a directory of theirs
                os.symlink(theirs, key_dir)
                os.mkdir(os.path.join(theirs, "n1"), 0o777)
                node = os.path.join(theirs, "n1")
            else:                       # their directory at our path, with a rank of theirs in it
                os.mkdir(key_dir, 0o777)
                os.chmod(key_dir, 0o777)
                node = os.path.join(key_dir, "n1")
                os.mkdir(node, 0o777)
            os.chmod(node, 0o777)
            with open(os.path.join(node, "rank99"), "w") as f:
                f.write("999 9999999999.0 -1 -1\n")
        as_user(other_user, planting)
        assert os.lstat(key_dir).st_uid == other_user.pw_uid
        assert _beat_through_sdk(monkeypatch, shm, hb, c.env_value)
        # Nothing of ours went into their directories ...
        for p in Path(theirs).rglob("*"):
            assert p.lstat().st_uid == other_user.pw_uid, p
        if plant == "directory":
            for p in Path(key_dir).rglob("*"):
                assert p.lstat().st_uid == other_user.pw_uid, p
        # ... no rank of theirs reached the supervisor, and rank 0 still did (its own file).
        beats = c.snapshot(expected_ranks=1)
        assert sorted(beats) == [0] and beats[0][0] == 5
        assert protocol.read_heartbeats(hb)[0][0] == 5
    finally:
        c.close()


@pytest.mark.parametrize("addr", ["file", "127.0.0.1:9/"])
def test_an_address_without_a_token_is_refused_not_served_from_a_predictable_directory(
        tmp_path, monkeypatch, shm, addr):
    hb = tmp_path / "hb"
    hb.mkdir()
    assert _beat_through_sdk(monkeypatch, shm, hb, addr, step=3)
    assert os.listdir(shm) == []                       # no node-local directory at all
    assert protocol.read_heartbeats(hb)[0][0] == 3     # this rank's heartbeat file instead
    with pytest.raises(hbc.ChannelRefused):
        hbc.NodeSender(addr, str(hb), 0, node="n1", root=shm)


def test_a_local_directory_that_is_not_private_is_refused(tmp_path):
    root = tmp_path / "shm"
    root.mkdir()
    addr = "file/" + "ab" * 16
    local = hbc.local_dir(addr, str(tmp_path / "hb"), "n1", str(root))
    os.makedirs(local, mode=0o755)
    os.chmod(os.path.dirname(local), 0o755)
    with pytest.raises(hbc.ChannelRefused, match="open to other users"):
        hbc.NodeSender(addr, str(tmp_path / "hb"), 0, node="n1", root=str(root))


# ------------------------------------------------------------------------------ the state file
@pytest.mark.parametrize("text, field", [
    ("[]", "JSON object"),
    ("null", "JSON object"),
    ('"restarts"', "JSON object"),
    ("{torn", "not JSON"),
    ("", "not JSON"),
    ('{"bad_nodes": {}, "attempts": 2, "restarts": "x", "no_progress": 0, "last_ckpt_step": null}', "restarts"),
    ('{"bad_nodes": {}, "attempts": 2.5, "restarts": 1, "no_progress": 0, "last_ckpt_step": null}', "attempts"),
    ('{"bad_nodes": {}, "attempts": 2, "restarts": -1, "no_progress": 0, "last_ckpt_step": null}', "restarts"),
    ('{"bad_nodes": {}, "attempts": 2, "restarts": true, "no_progress": 0, "last_ckpt_step": null}', "restarts"),
    ('{"bad_nodes": {}, "attempts": 2, "no_progress": 0, "last_ckpt_step": null}', "restarts"),
    ('{"bad_nodes": [], "attempts": 2, "restarts": 1, "no_progress": 0, "last_ckpt_step": null}', "bad_nodes"),
    ('{"bad_nodes": {"n1": 3}, "attempts": 2, "restarts": 1, "no_progress": 0, "last_ckpt_step": null}',
     "bad_nodes"),
    ('{"bad_nodes": {}, "attempts": 2, "restarts": 1, "no_progress": 0, "last_ckpt_step": "10"}',
     "last_ckpt_step"),
])
def test_a_corrupt_state_file_is_a_one_line_error_and_nothing_is_launched(world, tmp_path, text, field):
    job = tmp_path / "job"
    job.mkdir()
    (job / svrun.STATE_FILE).write_text(text)
    run = fast.make_run(world, tmp_path, preflight=None)
    with pytest.raises(InputError) as e:
        run.run()
    msg = e.value.message
    assert "\n" not in msg and svrun.STATE_FILE in msg and field in msg, msg
    assert fast.train_spawns(world) == [] and world.runner.spawns == []
    assert [r["error"] for r in fast.events(tmp_path, "state_invalid")] == [msg]
    assert (job / svrun.STATE_FILE).read_text() == text          # kept as it was, for a person to look at


def test_a_state_file_carries_the_budget_across_incarnations(world, tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    mem = sv.Memory(bad_nodes={"n9": "clusterops: preflight failed"}, attempts=4, restarts=3, no_progress=1,
                    last_ckpt_step=20)
    svrun.save_memory(job, mem)
    assert svrun.load_memory(job) == mem
    assert svrun.load_memory(tmp_path / "nowhere") == sv.Memory()


def test_clusterops_supervise_says_a_corrupt_state_file_in_one_line_exit_2(tmp_path, monkeypatch, capsys):
    from test_supervisor_cli import run_main

    job = tmp_path / "job"
    job.mkdir()
    (job / svrun.STATE_FILE).write_text("[]")
    env = {"SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_ID": "1"}
    code = run_main(["supervise", "--job-dir", str(job), "--preflight", "none", "--", "true"], monkeypatch, env)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and svrun.STATE_FILE in err and "Traceback" not in err, err
    bad = run_main(["supervise", "--job-dir", str(tmp_path / "j2"), "--job-dir-mode", "0777", "--preflight", "none",
                    "--", "true"], monkeypatch, env)
    err = capsys.readouterr().err
    assert bad == 2 and "job_dir_mode" in err and not (tmp_path / "j2").exists(), err


def test_a_job_spec_asks_for_another_job_dir_mode(tmp_path):
    from test_launch import write_spec
    from clusterops import launch

    spec = launch.load_spec(write_spec(tmp_path, """
        name: t
        nodes: 2
        launcher: srun
        script: train.py
        supervise:
          job_dir_mode: 0750
        """))
    assert spec.supervise_dict["job_dir_mode"] == "0750"          # as written, not YAML 1.1 octal
    with pytest.raises(InputError, match=r"job.yaml:\d+: supervise.job_dir_mode: must be one of 0700, 0750, 0755"):
        launch.load_spec(write_spec(tmp_path, """
            name: t
            nodes: 2
            launcher: srun
            script: train.py
            supervise:
              job_dir_mode: "0777"
            """))
