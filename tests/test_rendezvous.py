"""The rendezvous host (clusterops.supervisor.rendezvous) on a real torch TCPStore, with the
ranks' own protocol (clusterops.recover): joins appended to join/<G>, one round trip each;
a failed collective reported by the first rank only."""

from __future__ import annotations

import json
import time

import pytest

from clusterops import protocol


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


def client_store(h):
    from clusterops import rdzvstore

    return rdzvstore.connect(h.addr, 10)


def opened(st, key):
    return st.peek(key)


def test_joins_appended_one_line_a_rank_form_the_next_generation(host):
    from clusterops.recover import send_join, send_report

    st = client_store(host)
    for i, node in enumerate(["n1", "n2", "n3"]):
        for local in (0, 1):
            send_report(st, f"{node}:{local}", "hello", node=node, local=local, task=2 * i + local)
    plan0 = json.loads(wait_until(lambda: opened(st, "plan/0")))
    assert plan0["ranks"] == {"n1:0": 0, "n2:0": 1, "n3:0": 2}
    send_report(st, "n2:1", "dead", dead="n2:0")
    send_join(st, 1, "n1:0", 0, 41)
    assert opened(st, "plan/1") is None
    line = st.sealer.seal_line("join/1", protocol.rdzv_join_line("n3:0", 2, 42))
    st.raw.append("join/1", line[:20])          # a line cut short (no newline) is not read yet
    time.sleep(0.1)
    assert opened(st, "plan/1") is None and host.membership.recovery.joined == {0: 41}
    st.raw.append("join/1", line[20:])          # now it is whole: rank 2 at step 42
    plan1 = json.loads(wait_until(lambda: opened(st, "plan/1")))
    assert plan1["ranks"] == {"n1:0": 0, "n2:1": 1, "n3:0": 2} and plan1["src"] == 2 and plan1["step"] == 42
    note = next(n for n in wait_until(host.drain_notes) if n.kind == "inproc_rendezvous")
    assert note.data["replaced"][0]["uid"] == "n2:1"


def test_only_the_first_failed_rank_sends_its_report(host, monkeypatch):
    from clusterops import recover

    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    a, b = recover._Client(host.addr, 10), recover._Client(host.addr, 10)
    a.fail(0, 0, 7, "RuntimeError: Connection closed by peer")
    b.fail(0, 1, 7, "RuntimeError: Connection closed by peer")
    a.fail(1, 0, 9, "RuntimeError: again, in the next generation")
    assert a.store.add(protocol.RDZV_REPORTS, 0) == 2          # one report each generation, not one a rank
    first = json.loads(a.store.peek("rep/1"))
    assert first["kind"] == "fail" and first["rank"] == 0 and first["gen"] == 0


def test_parse_joins_skips_what_is_not_a_join():
    assert protocol.parse_rdzv_joins(["n1:7 0 5", "n2:8 12 5", "x y", "n3:9 3", " 3 4"]) == [
        ("n1:7", 0, 5), ("n2:8", 12, 5)]
    assert protocol.rdzv_join_line("n1:7", 3, 17) == "n1:7 3 17"


def test_a_fault_sets_the_next_generations_abort_key_for_the_ranks_watchers(host):
    from clusterops.recover import send_report

    st = client_store(host)
    for i, node in enumerate(["n1", "n2", "n3"]):
        for local in (0, 1):
            send_report(st, f"{node}:{local}", "hello", node=node, local=local, task=2 * i + local)
    wait_until(lambda: opened(st, "plan/0"))
    assert not st.exists(["abort/1"])
    send_report(st, "n2:1", "dead", dead="n2:0")
    assert b"rank 1 lost" in wait_until(lambda: opened(st, "abort/1"))


def test_abort_watch_aborts_once_when_its_generation_is_opened_and_never_after_stop(host):
    import threading

    from clusterops.recover import AbortWatch

    fired = threading.Event()
    calls = []

    def abort():
        calls.append(time.monotonic())
        fired.set()

    w = AbortWatch(client_store(host), 5, abort=abort).start()
    quiet = AbortWatch(client_store(host), 6, abort=abort).start()
    time.sleep(1.5)              # past one wait's timeout: it waits again, nothing fired
    assert not fired.is_set() and not w.fired
    quiet.stop()
    st = client_store(host)
    st.set("abort/5", "rank 2 lost")
    st.set("abort/6", "rank 2 lost")
    assert fired.wait(5.0) and w.fired
    time.sleep(1.5)              # the stopped watcher sees its key only after stop: no call
    assert len(calls) == 1 and not quiet.fired
