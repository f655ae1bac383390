"""A hang with a name (issue 29, part 5): the flight recorders' dumps read (pure), the dump
request carried by the beacons, and the machine's use of the name (fake clock)."""

from __future__ import annotations

import json

from support.machine import P, only, records
from clusterops import heartbeat as hbc
from clusterops import protocol
from clusterops.supervisor import (HangNamed, Heartbeats, Launch, ResumeChosen, StepExited,
                                   StepLaunched, Supervisor)
from clusterops.supervisor.flightrec import name_hang


def dump(rank, enq, comp, op="gloo:all_reduce", pg="0"):
    """A rank's dump in the shape sdk._dump_flight_recorder writes (pg_status as torch 2.13's
    _dump_fr_trace_json gives it for gloo: strings)."""
    return {"rank": rank, "request": 1, "pg_status": {pg: {"last_enqueued_collective": str(enq),
                                                            "last_completed_collective": str(comp),
                                                            "last_started_collective": "-1"}},
            "entries": [{"collective_seq_id": enq, "profiling_name": op, "state": "scheduled",
                         "process_group": [pg, "default_pg"]}]}


def test_the_rank_that_never_entered_is_named():
    # Recorded on this machine (3 gloo ranks, rank 1 never called the 4th all_reduce).
    n = name_hang({0: dump(0, 4, 3), 1: dump(1, 3, 3), 2: dump(2, 4, 3)}, [0, 1, 2])
    assert n.ranks == (1,) and "never entered collective 4 (gloo:all_reduce)" in n.why and n.silent == ()


def test_every_rank_in_the_collective_or_none_waiting_names_nobody():
    n = name_hang({r: dump(r, 4, 3) for r in range(3)}, [0, 1, 2])
    assert n.ranks == () and "every rank entered" in n.why
    n = name_hang({r: dump(r, 4, 4) for r in range(3)}, [0, 1, 2])
    assert n.ranks == () and "no rank waits" in n.why


def test_a_rank_without_a_dump_is_listed_not_named():
    n = name_hang({0: dump(0, 4, 3), 2: dump(2, 4, 3)}, [0, 1, 2])
    assert n.ranks == () and n.silent == (1,) and "no dump from rank(s) 1" in n.why
    n = name_hang({0: {"rank": 0, "request": 1, "error": "AttributeError: no recorder"}}, [0])
    assert n.ranks == () and n.unusable == (0,)


def test_dump_files_round_trip_and_old_requests_are_ignored(tmp_path):
    protocol.write_flightrec(tmp_path, 3, dump(3, 4, 3))
    old = dict(dump(5, 2, 2), request=0)
    protocol.write_flightrec(tmp_path, 5, old)
    (tmp_path / protocol.FLIGHTREC_DIR / "rank7.json").write_text("{torn")
    assert sorted(protocol.read_flightrecs(tmp_path, 1)) == [3]


def test_beacon_carries_the_dump_request_and_old_beacons_still_decode():
    b = hbc.decode_beacon(hbc.encode_beacon("t" * 32, 5, 60000, 2), "t" * 32)
    assert (b.seq, b.lost_ms, b.dump) == (5, 60000, 2)
    plain = json.dumps({"v": hbc.VERSION, "tok": "t" * 32, "kind": "beacon", "seq": 1, "lost_ms": 9},
                       separators=(",", ":")).encode()
    assert hbc.decode_beacon(plain, "t" * 32).dump == 0


def _hang(s, now, named):
    s.handle(StepLaunched(now))
    beats = {r: (15, now + 1.0) for r in range(3)}          # all fell silent together
    acts = s.handle(Heartbeats(now + 40.0, beats))
    assert records(acts, "heartbeat_lost")[0].data["culprits"] == []
    acts = s.handle(HangNamed(now + 41.0, named, "process group 0: rank(s) 2 never entered collective 31"))
    rec = records(acts, "hang_named")[0].data
    assert rec["ranks"] == list(named) and rec["nodes"] == (["c"] if named else [])
    return s.handle(StepExited(now + 42.0, returncode=-9))


def test_a_rank_named_twice_leaves_its_node_out():
    s = Supervisor(P(nodes=3, spare_nodes=1, node_fail_threshold=2, hang_timeout_s=20), ["a", "b", "c", "d"])
    s.start(1000.0)
    s.handle(ResumeChosen(1000.0, None, "", ()))
    acts = _hang(s, 1000.0, (2,))
    e = records(acts, "step_exit")[0].data
    assert e["cause"] == "hang" and e["blamed"] == ["c"] and not records(acts, "node_bad")
    assert [a for a in acts if isinstance(a, Launch)][0].nodes == ("a", "b", "c")
    acts = _hang(s, 2000.0, (2,))
    assert records(acts, "node_bad")[0].data["node"] == "c"
    assert [a for a in acts if isinstance(a, Launch)][0].nodes == ("a", "b", "d")


def test_no_name_blames_nobody():
    s = Supervisor(P(nodes=3, node_fail_threshold=1, hang_timeout_s=20), ["a", "b", "c"])
    s.start(1000.0)
    s.handle(ResumeChosen(1000.0, None, "", ()))
    acts = _hang(s, 1000.0, ())
    assert records(acts, "step_exit")[0].data["blamed"] == [] and not records(acts, "node_bad")
