"""NCCL's RAS report on a hang (clusterops.supervisor.ncclras): the parse of the JSON layout,
which ranks it names and only for this job's communicators, and the client protocol against
a local server that speaks it (NCCL is not on this machine: see tests/fixtures/ncclras)."""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from support.machine import P, records
from clusterops.supervisor import HangNamed, Heartbeats, ResumeChosen, StepExited, StepLaunched, Supervisor
from clusterops.supervisor import ncclras

FIX = Path(__file__).parent / "fixtures" / "ncclras"
JOB_PIDS = [4100, 4101, 4102, 4103]


def report(name):
    return ncclras.parse((FIX / name).read_text())


def test_parse_reads_ranks_counts_and_missing_ranks():
    r = report("dead.json")
    assert r.nccl_version == "2.28.3" and r.timeouts == 1 and len(r.communicators) == 1
    c = r.communicators[0]
    assert [x.rank for x in c.ranks] == [0, 1, 3] and c.size == 4
    assert [(m.rank, m.host, m.pid, m.dead, m.unresponsive) for m in c.missing] == [(2, "10.0.0.13", 4102, True, True)]
    assert dict(c.ranks[0].counts)["AllReduce"] == 1208


@pytest.mark.parametrize("name,ranks,why", [
    ("behind.json", (2,), "rank 2: behind: AllReduce 1207 of 1208"),
    ("dead.json", (2,), "rank 2: dead"),
])
def test_the_rank_behind_or_missing_is_named(name, ranks, why):
    n = ncclras.name_ranks(report(name), JOB_PIDS)
    assert (n.ranks, n.why, n.communicators, n.foreign) == (ranks, why, 1, 0)


def test_even_counts_name_nobody():
    n = ncclras.name_ranks(report("even.json"), JOB_PIDS)
    assert n.ranks == () and n.communicators == 1 and "same counts" in n.why


def test_another_jobs_report_names_nobody_of_ours():
    # The report is of processes that are not this job's (another user's job at the port).
    n = ncclras.name_ranks(report("foreign.json"), JOB_PIDS)
    assert n.ranks == () and n.communicators == 0 and n.foreign == 1
    # Without any pid of ours (every rank silent), nothing can be matched: nobody named.
    assert ncclras.name_ranks(report("behind.json"), []).ranks == ()


@pytest.mark.parametrize("text", ["", "[]", '{"communicators": 3}', '{"communicators": [{"ranks": [{"host": "x"}]}]}'])
def test_malformed_reports_are_refused(text):
    with pytest.raises(ValueError):
        ncclras.parse(text)


def test_address_from_the_environment():
    assert ncclras.address({}) == ("127.0.0.1", 28028)
    assert ncclras.address({"NCCL_RAS_ADDR": "localhost:30000"}) == ("localhost", 30000)
    assert ncclras.address({"NCCL_RAS_ADDR": "[::1]:30001"}) == ("::1", 30001)
    assert ncclras.address({"NCCL_RAS_ADDR": "nonsense"}) == ("127.0.0.1", 28028)


class RasServer:
    """A local TCP server that answers like NCCL's RAS listener (the client protocol: one
    command a line, then the report and close)."""

    def __init__(self, report: str, json_format: bool = True):
        self.report, self.json_format, self.commands = report, json_format, []
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(4)
        self.port = self.sock.getsockname()[1]
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self):
        conn, _ = self.sock.accept()
        with conn, conn.makefile("rwb") as f:
            for line in f:
                cmd = line.decode().strip()
                self.commands.append(cmd)
                if cmd.startswith("CLIENT PROTOCOL"):
                    f.write(b"SERVER PROTOCOL 2\n")
                elif cmd.startswith("TIMEOUT"):
                    f.write(b"OK\n")
                elif cmd.startswith("SET FORMAT"):
                    f.write(b"OK\n" if self.json_format else b"ERROR: Invalid format json\n")
                elif cmd == "STATUS":
                    f.write(self.report.encode())
                    f.flush()
                    return
                f.flush()

    def close(self):
        self.sock.close()


def test_query_speaks_the_protocol_and_reads_the_json_report():
    srv = RasServer((FIX / "behind.json").read_text())
    try:
        naming, raw = ncclras.ask({"NCCL_RAS_ADDR": f"127.0.0.1:{srv.port}"}, JOB_PIDS)
    finally:
        srv.close()
    assert naming is not None and naming.ranks == (2,)
    assert raw.lstrip().startswith("{")
    assert srv.commands == ["CLIENT PROTOCOL 2", "TIMEOUT 3", "SET FORMAT json", "STATUS"]


def test_a_text_only_server_is_kept_not_read():
    text = "NCCL version 2.24.3\n...\nCommunicators... (0.00s)\n"
    srv = RasServer(text, json_format=False)
    try:
        naming, raw = ncclras.ask({"NCCL_RAS_ADDR": f"127.0.0.1:{srv.port}"}, JOB_PIDS)
    finally:
        srv.close()
    assert naming is None and raw == text


def test_no_listener_or_a_stranger_is_no_report():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()                                                  # nothing listens there
    assert ncclras.ask({"NCCL_RAS_ADDR": f"127.0.0.1:{port}"}, JOB_PIDS) == (None, None)
    stranger = socket.socket()
    stranger.bind(("127.0.0.1", 0))
    stranger.listen(1)

    def talk():
        c, _ = stranger.accept()
        with c:
            c.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    t = threading.Thread(target=talk, daemon=True)
    t.start()
    try:
        assert ncclras.ask({"NCCL_RAS_ADDR": f"127.0.0.1:{stranger.getsockname()[1]}"}, JOB_PIDS) == (None, None)
    finally:
        stranger.close()


def test_the_machine_takes_a_ras_naming_and_records_its_source():
    s = Supervisor(P(nodes=3, node_fail_threshold=1, hang_timeout_s=20), ["a", "b", "c"])
    s.start(1000.0)
    s.handle(ResumeChosen(1000.0, None, "", ()))
    s.handle(StepLaunched(1000.0))
    s.handle(Heartbeats(1040.0, {r: (15, 1001.0) for r in range(3)}))      # all fell silent together
    acts = s.handle(HangNamed(1041.0, (2,), "rank 2: behind: AllReduce 1207 of 1208", (), source="nccl_ras",
                              ras="2: rank 2: behind: AllReduce 1207 of 1208"))
    rec = records(acts, "hang_named")[0].data
    assert (rec["source"], rec["ranks"], rec["nodes"]) == ("nccl_ras", [2], ["c"]) and rec["ras"].startswith("2: ")
    acts = s.handle(StepExited(1042.0, returncode=-9))
    assert records(acts, "step_exit")[0].data["blamed"] == ["c"]
