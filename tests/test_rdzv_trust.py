"""What a stranger who reaches the in-process rendezvous's port can and cannot do, on a real torch
TCPStore with the project's own host (clusterops.supervisor.rendezvous) and ranks' side
(clusterops.recover): values sealed with the attempt's secret (clusterops.rdzvstore); a
forged plan, kill, abort, finish, report or join is nobody's word; a state transfer never
unpickles; a group member without the secret is found out."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops import protocol, rdzvstore


def wait_until(fn, timeout_s=10.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        v = fn()
        if v:
            return v
        time.sleep(0.01)
    raise AssertionError("not within the time")


@pytest.fixture
def host():
    from clusterops.supervisor.membership import Membership
    from clusterops.supervisor.rendezvous import RendezvousHost

    h = RendezvousHost(Membership(["n1", "n2", "n3"], 1, 1, timeout_s=60, unresponsive_s=60),
                       bind_host="127.0.0.1").start()
    yield h
    h.close()


def stranger(h):
    """A client that knows only the port: torch's own store, no secret."""
    import torch.distributed as dist

    _, port, _ = protocol.parse_rdzv_addr(h.addr)
    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5))


def hello_all(st):
    from clusterops.recover import send_report

    for i, node in enumerate(["n1", "n2", "n3"]):
        for local in (0, 1):
            send_report(st, f"{node}:{local}", "hello", node=node, local=local, task=2 * i + local)
    return json.loads(wait_until(lambda: st.peek("plan/0")))


def test_sealed_values_open_only_under_their_key_and_secret():
    a, b = rdzvstore.Sealer("s" * 64), rdzvstore.Sealer("t" * 64)
    blob = a.seal("plan/3", b'{"gen": 3}')
    assert a.open("plan/3", blob) == b'{"gen": 3}'
    assert b'"gen"' not in blob                        # encrypted: a stranger reads nothing
    assert a.open("plan/4", blob) is None              # bound to its key: no copying across keys
    assert b.open("plan/3", blob) is None              # another secret
    flipped = bytearray(blob)
    flipped[20] ^= 1
    assert a.open("plan/3", bytes(flipped)) is None    # one bit changed
    assert a.open("plan/3", blob[:-1]) is None and a.open("plan/3", b"") is None
    assert a.open("k", a.seal("k", b"")) == b""
    assert a.prefix != b.prefix and "s" * 8 not in a.prefix
    lines = (a.seal_line("join/1", "x 1 2") + "garbage\n" + b.seal_line("join/1", "y 2 3")).encode()
    assert a.open_lines("join/1", lines) == ["x 1 2"]


def test_a_stranger_lists_keys_but_finds_neither_the_secret_nor_a_readable_value(host):
    st = rdzvstore.connect(host.addr, 10)
    hello_all(st)
    s = stranger(host)
    keys = s.list_keys()
    assert keys and all(k.startswith(host.sealer.prefix) for k in keys)
    assert not any(host.token in k for k in keys)
    plan_key = next(k for k in keys if k.endswith("/plan/0"))
    raw = s.get(plan_key)
    assert b"ranks" not in raw and host.token.encode() not in raw


def test_forged_plan_kill_abort_finish_are_nobodys_word(host):
    from clusterops import recover

    st = rdzvstore.connect(host.addr, 10)
    hello_all(st)
    s = stranger(host)
    p = host.sealer.prefix
    forged = {"gen": 1, "world": 3, "ranks": {"n1:1": 0, "n2:0": 1, "n3:0": 2}, "standby": [], "src": 0, "step": 9}
    s.set(f"{p}/plan/1", json.dumps(forged))
    s.set(f"{p}/kill/n1:0", "n1")
    s.set(f"{p}/abort/1", "rank 0 lost")
    s.set(f"{p}/finish", "1")
    c = recover._Client.__new__(recover._Client)
    c.store, c.node, c.uid = st, "n1", "n1:1"
    assert c.plan(1, wait=False) is None               # the forged plan does not open
    assert c.finished() is None
    assert st.peek("kill/n1:0") is None and st.peek("abort/1") is None
    fired = []
    w = recover.AbortWatch(st, 1, abort=lambda: fired.append(1)).start()
    time.sleep(0.5)
    w.stop()
    assert not fired
    assert host.membership.recovery is None            # nothing was opened by any of it


def test_forged_reports_and_joins_are_dropped_and_a_bumped_counter_is_skipped(host, monkeypatch):
    from clusterops.recover import send_join, send_report
    from clusterops.supervisor import rendezvous

    monkeypatch.setattr(rendezvous, "REPORT_GAP_S", 0.3)
    st = rdzvstore.connect(host.addr, 10)
    hello_all(st)
    s = stranger(host)
    p = host.sealer.prefix
    n = s.add(f"{p}/rep/n", 1)                         # a forged report in a slot of its own
    s.set(f"{p}/rep/{n}", json.dumps({"kind": "dead", "uid": "n2:1", "dead": "n2:0"}))
    s.add(f"{p}/rep/n", 100000)                        # a counter bumped far ahead
    s.append(f"{p}/join/1", "n1:0 0 99\n")             # a forged join, old format
    time.sleep(0.5)
    assert host.membership.recovery is None
    assert host.membership.procs["n2:0"].alive
    # The job's own reports still get through, past the bumped counter's empty slots.
    send_report(st, "n2:1", "dead", dead="n2:0")
    wait_until(lambda: host.membership.recovery is not None, 10)
    send_join(st, 1, "n1:0", 0, 41)
    send_join(st, 1, "n2:0", 2, 99)                    # a real line, but not the holder of rank 2
    send_join(st, 1, "n3:0", 2, 42)
    plan1 = json.loads(wait_until(lambda: st.peek("plan/1")))
    assert plan1["src"] == 2 and plan1["step"] == 42
    notes = [n for n in host.drain_notes() if n.kind == "warning"]
    assert any("skipped" in n.data["what"] for n in notes)


def test_the_first_fail_report_is_sent_even_when_a_stranger_set_the_slot(host, monkeypatch):
    from clusterops import recover

    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    s = stranger(host)
    s.set(f"{host.sealer.prefix}/fail/0", "me first")
    a = recover._Client(host.addr, 10)
    before = a.store.add(protocol.RDZV_REPORTS, 0)
    a.fail(0, 0, 7, "RuntimeError: Connection closed by peer")
    assert a.store.add(protocol.RDZV_REPORTS, 0) == before + 1


def test_a_kill_order_reaches_only_a_process_of_this_attempt(monkeypatch, tmp_path):
    from clusterops import recover

    env = dict(os.environ, SLURM_JOB_ID="77", **{protocol.ENV_RDZV_ADDR: "127.0.0.1:1/sekrit"})
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                              env=dict(env, **{protocol.ENV_RDZV_ADDR: "127.0.0.1:1/other"}))
    try:
        monkeypatch.setenv("SLURM_JOB_ID", "77")
        monkeypatch.setenv(protocol.ENV_RDZV_ADDR, "127.0.0.1:1/sekrit")
        time.sleep(0.2)
        assert recover._of_this_attempt(ours.pid)
        assert not recover._of_this_attempt(theirs.pid)       # same user, another attempt
        assert not recover._of_this_attempt(1)                # not even readable
        monkeypatch.setenv("SLURM_JOB_ID", "78")
        assert not recover._of_this_attempt(ours.pid)
    finally:
        ours.kill()
        theirs.kill()


TRANSFER = r"""
import datetime, io, pickle, sys
from pathlib import Path
import torch, torch.distributed as dist
from clusterops import recover
rank, port, mode, canary = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=20))
dist.init_process_group("gloo", store=dist.PrefixStore(mode, store), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))

class Evil:
    def __reduce__(self):
        return (Path.touch, (Path(canary),))

class State:
    def __init__(self, sd):
        self.sd, self.loaded = sd, None
    def state_dict(self):
        return self.sd
    def load_state_dict(self, d):
        self.loaded = d

sd = {"w": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3) * (rank + 1), "step": 5 + rank, "t": (1, 2.5)}
st = State(sd)
if rank == 0 and mode == "evil":     # a forged source: the same wire format, a pickle that runs code
    buf = io.BytesIO()
    torch.save({"x": Evil()}, buf)
    payload = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    dist.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src=0)
    dist.broadcast(payload, src=0)
    print("sent")
else:
    try:
        recover._transfer(st, 0, rank)
    except pickle.UnpicklingError as e:
        print("refused")
    else:
        got = st.loaded if rank == 1 else sd
        print("loaded", got["step"], got["t"], got["w"].dtype, got["w"].view(torch.int16).tolist())
"""


def test_the_state_transfer_loads_tensors_bitwise_and_never_runs_a_pickle(tmp_path):
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=20))
    script = tmp_path / "transfer.py"
    script.write_text(TRANSFER)
    canary = tmp_path / "ran"

    def pair(mode):
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(server.port), mode, str(canary)],
                                  stdout=subprocess.PIPE, text=True) for r in (0, 1)]
        return [p.communicate(timeout=60)[0].strip() for p in procs]

    good = pair("good")
    assert good[0] == good[1] and good[1].startswith("loaded 5 (1, 2.5) torch.bfloat16"), good
    evil = pair("evil")
    assert evil == ["sent", "refused"], evil
    assert not canary.exists()


VERIFY = r"""
import datetime, sys, torch.distributed as dist
from clusterops import rdzvstore, recover
rank, port, secret, prefix = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
tcp = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=20))
st = rdzvstore.SealedStore(tcp, rdzvstore.Sealer("shared-store-secret"), 20)
dist.init_process_group("gloo", store=dist.PrefixStore(prefix, st.torch_store), rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=20))
try:
    recover._verify_group(rdzvstore.Sealer(secret), 0, rank, 2, "gloo")
    print("verified")
except recover.GroupNotAuthentic as e:
    print("refused", e)
"""


def test_a_group_member_without_the_secret_is_found_out_once_the_group_forms(tmp_path):
    """Two processes form a gloo group on the sealed store (so the formation itself works on it);
    the second then holds another secret for the tags, as a stranger who got into a connection
    would: both refuse the group."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=20))
    script = tmp_path / "verify.py"
    script.write_text(VERIFY)

    def pair(secret_b):
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(server.port), s, f"pg/{secret_b}"],
                                  stdout=subprocess.PIPE, text=True)
                 for r, s in ((0, "job"), (1, secret_b))]
        return [p.communicate(timeout=60)[0].strip() for p in procs]

    assert pair("job") == ["verified", "verified"]
    got = pair("stranger")
    assert all(g.startswith("refused") for g in got), got
