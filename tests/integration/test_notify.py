"""Webhook notifications against a real HTTP server on 127.0.0.1: generic JSON and
Slack-compatible payloads, retries, a server that is down, slow or refusing, and the
sweep telling a webhook that it could not run and what it drained."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from clusterops import notify
from support.webhook import Hook
from clusterops.errors import InputError

CLUSTEROPS = str(Path(sys.executable).parent / "clusterops")


@pytest.fixture
def hook():
    hooks = []

    def make(**kw):
        h = Hook(**kw)
        hooks.append(h)
        return h

    yield make
    for h in hooks:
        h.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_generic_json_and_slack_payloads(hook):
    h = hook()
    n = notify.Notifier(notify.parse_targets([{"url": h.url}, {"url": h.url, "format": "slack"}]))
    n.send("node_drained", "node3 drained: clusterops:sweep: matmul: slow", {"node": "node3", "reason": "x"})
    done = n.close(5)
    assert [d.ok for d in done] == [True, True] and all(d.attempts == 1 for d in done)
    by_kind = {("slack" if "text" in doc else "json"): (ctype, doc) for _, ctype, doc in h.got}
    ctype, doc = by_kind["json"]
    assert ctype == "application/json"
    assert doc["event"] == "node_drained" and doc["details"]["node"] == "node3" and doc["source"] == "clusterops"
    assert "node3 drained" in by_kind["slack"][1]["text"] and "`node_drained`" in by_kind["slack"][1]["text"]


def test_retries_on_server_errors_then_delivers(hook):
    h = hook(script=[500, 503])
    n = notify.Notifier(notify.parse_targets([{"url": h.url, "retries": 3, "timeout_s": 2}]), backoff_s=0.05)
    n.send("guard_tripped", "guard", {})
    (d,) = n.close(10)
    assert d.ok and d.attempts == 3 and len(h.got) == 3


def test_a_client_error_is_not_retried_and_the_secret_is_not_shown(hook):
    h = hook(script=[404])
    n = notify.Notifier(notify.parse_targets([{"url": h.url, "retries": 3}]), backoff_s=0.05)
    n.send("node_resumed", "n1 resumed", {})
    (d,) = n.close(10)
    assert not d.ok and d.attempts == 1 and d.status == 404
    assert "SECRET" not in d.error and "HTTP 404" in d.error


def test_server_down_costs_little_and_never_raises():
    url = f"http://127.0.0.1:{closed_port()}/hook"
    n = notify.Notifier(notify.parse_targets([{"url": url, "retries": 2, "timeout_s": 1}]), backoff_s=0.05)
    t0 = time.monotonic()
    n.send("sweep_cannot_run", "no Slurm", {})
    assert time.monotonic() - t0 < 0.2            # send() returns at once
    (d,) = n.close(10)
    assert not d.ok and d.attempts == 3 and "refused" in d.error.lower() and "\n" not in d.error
    assert time.monotonic() - t0 < 3


def test_a_hanging_server_never_blocks_past_close(hook):
    h = hook(delay_s=5)
    n = notify.Notifier(notify.parse_targets([{"url": h.url, "timeout_s": 30, "retries": 0}]))
    n.send("guard_tripped", "guard", {})
    t0 = time.monotonic()
    (d,) = n.close(0.5)
    assert time.monotonic() - t0 < 1.5
    assert not d.ok and "abandoned" in d.error


def test_events_filter_and_bad_config():
    (t,) = notify.parse_targets([{"url": "https://hooks.example/x", "events": ["guard_tripped"]}])
    assert t.wants("guard_tripped") and not t.wants("node_drained")
    for bad, field in (([{"url": "ftp://x/y"}], "url"), ([{"url": "http://h/x", "format": "teams"}], "format"),
                       ([{"url": "http://h/x", "events": ["node_exploded"]}], "events"),
                       ([{"url": "http://h/x", "timeout_s": 0}], "timeout_s"),
                       ([{"url": "http://h/x", "retries": 99}], "retries"),
                       ([{"url": "http://h/x", "color": "red"}], "color"), ({"url": "http://h"}, "list")):
        with pytest.raises(InputError, match=field):
            notify.parse_targets(bad)


def test_sweep_that_cannot_run_notifies_and_a_bad_notify_config_is_exit_2(hook, tmp_path):
    h = hook()
    cfg = tmp_path / "notify.yaml"
    cfg.write_text(f"notify:\n  - url: {h.url}\n    format: json\n")
    env = dict(os.environ, SLURM_CONF=str(tmp_path / "missing.conf"))
    o = subprocess.run([CLUSTEROPS, "sweep", "--db", str(tmp_path / "s.db"), "--notify-config", str(cfg)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert o.returncode == 5, o.stderr
    assert [doc["event"] for _, _, doc in h.got] == ["sweep_cannot_run"]
    assert "could not run" in h.got[0][2]["summary"]
    # The webhook down: the sweep's own exit code stands, with a warning.
    cfg.write_text(f"notify:\n  - url: http://127.0.0.1:{closed_port()}/x\n    retries: 0\n")
    o = subprocess.run([CLUSTEROPS, "sweep", "--db", str(tmp_path / "s.db"), "--notify-config", str(cfg)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert o.returncode == 5 and "notification sweep_cannot_run not delivered" in o.stderr
    cfg.write_text("notify:\n  - url: gopher://x\n")
    o = subprocess.run([CLUSTEROPS, "sweep", "--db", str(tmp_path / "s.db"), "--notify-config", str(cfg)],
                       capture_output=True, text=True, timeout=60, env=env)
    assert o.returncode == 2 and "notify[0].url" in o.stderr and o.stderr.count("\n") == 1


@pytest.mark.integration
def test_dev_cluster_sweep_notifies_the_drain(cluster, hook, tmp_path):
    from integration.test_sweep_slurm import PROFILE, BrokenScratch

    h = hook()
    cfg = tmp_path / "notify.yaml"
    cfg.write_text(f"notify:\n  - url: {h.url}\n  - url: {h.url}\n    format: slack\n    events: [node_drained]\n")
    profile = tmp_path / "sweeptest.yaml"
    profile.write_text(PROFILE)
    with BrokenScratch(cluster, "node3"):
        o = subprocess.run([CLUSTEROPS, "sweep", "--profile", str(profile), "--db", str(tmp_path / "s.db"),
                            "--timeout", "90", "--drain", "--max-drain-fraction", "0.5", "--json", "--quiet",
                            "--notify-config", str(cfg)], capture_output=True, text=True, timeout=180)
    assert o.returncode == 1, o.stderr
    doc = json.loads(o.stdout)
    assert [d["ok"] for d in doc["notifications"]] == [True, True]
    events = sorted((("slack" if "text" in d else d["event"]), (d.get("details") or {}).get("node"))
                    for _, _, d in h.got)
    assert events == [("node_drained", "node3"), ("slack", None)]


@pytest.mark.integration
def test_health_check_self_drain_and_resume_notify(cluster, hook, tmp_path):
    """`health check --drain-on-fail` tells the site config's webhooks when it drains its node
    and when it lifts that drain again; a passing check with nothing to lift sends nothing."""
    from integration.test_drains_cluster import SITE, Broken, check, state

    h = hook()
    (tmp_path / "site.yaml").write_text(SITE + f"notify:\n  - url: {h.url}\n")
    site_arg = ("--site-config", str(tmp_path / "site.yaml"))
    code, _, err = check(cluster, tmp_path, "node2", *site_arg)
    assert code == 0 and h.got == [], err
    with Broken(cluster, "node2"):
        code, rep, err = check(cluster, tmp_path, "node2", *site_arg)
        assert code == 1 and rep["slurm"]["action"] == "drain", err
    assert state(cluster, "node2")[0]
    code, rep, err = check(cluster, tmp_path, "node2", *site_arg)
    assert code == 0 and rep["slurm"]["action"] == "resume", err
    events = [(d["event"], d["details"]["node"]) for _, _, d in h.got]
    assert events == [("node_drained", "node2"), ("node_resumed", "node2")]
    assert h.got[0][2]["details"]["reason"].startswith("clusterops:health:fast: ")


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_a_garbage_webhook_never_stops_the_drain_report_history_or_metrics(cluster, tmp_path):
    """A webhook answering a garbage status line: node3 is still drained, and the report,
    the history row and the Prometheus file are all written; the warning says what came
    back, without the URL's path or userinfo."""
    import socketserver
    import threading

    from integration.test_sweep_slurm import PROFILE, BrokenScratch, nodes_state

    class Garbage(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.settimeout(2)
            try:
                self.request.recv(65536)
            except OSError:
                pass
            self.request.sendall(b"SPAM\r\n\r\n")

    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Garbage)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        cfg = tmp_path / "notify.yaml"
        cfg.write_text(f"notify:\n  - http://u:hunter2@127.0.0.1:{srv.server_address[1]}/SECRET-TOKEN\n")
        profile = tmp_path / "sweeptest.yaml"
        profile.write_text(PROFILE)
        db, prom, page = tmp_path / "s.db", tmp_path / "sweep.prom", tmp_path / "sweep.html"
        with BrokenScratch(cluster, "node3"):
            o = subprocess.run([CLUSTEROPS, "sweep", "--profile", str(profile), "--db", str(db), "--timeout", "90",
                                "--drain", "--max-drain-fraction", "0.5", "--quiet", "--notify-config", str(cfg),
                                "--prometheus", str(prom), "--report", str(page)],
                               capture_output=True, text=True, timeout=180)
    finally:
        srv.shutdown()
        srv.server_close()
    assert o.returncode == 1, o.stderr
    assert "notification node_drained not delivered" in o.stderr and "garbage status line" in o.stderr
    assert "SECRET-TOKEN" not in o.stderr and "hunter2" not in o.stderr and "Traceback" not in o.stderr
    assert 'clusterops_sweep_node_healthy{node="node3"} 0' in prom.read_text()
    assert "node3" in page.read_text()
    from clusterops.history import History

    with History.open(str(db), create=False) as h:
        assert [r.status for r in h.rows(node="node3", probe="check")] == ["fail"]
    st = nodes_state()
    assert "DRAIN" in st["node3"][0] and st["node3"][1].startswith("clusterops:sweep: ")
