"""Webhooks never break the path that sends them (issue 18), against real sockets on 127.0.0.1.

A garbage status line, a URL that http.client refuses, a closed port, a slow server: post()
never raises, the delivery and the log say what happened in words, and neither shows the
URL's path, query or userinfo. A URL with a bad port is refused when the config is
validated, also by ``health profiles --check``.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading

import pytest

from clusterops import notify
from clusterops.cli import main as cli_main
from clusterops.errors import InputError
from support.webhook import Hook

SECRETS = ("SECRET-TOKEN", "hunter2", "alice", "tok=", "query-secret")


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as ex:
        cli_main(list(argv))
    out, err = capsys.readouterr()
    return ex.value.code, out, err


class _Garbage(socketserver.BaseRequestHandler):
    """Reads the request, answers a status line that is not HTTP, closes."""

    def handle(self):
        self.server.hits += 1
        self.request.settimeout(2)
        try:
            self.request.recv(65536)
        except OSError:
            pass
        self.request.sendall(self.server.answer)


@pytest.fixture
def garbage_server():
    servers = []

    def make(answer=b"SPAM EGGS\r\n\r\n"):
        srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Garbage)
        srv.daemon_threads = True
        srv.answer, srv.hits = answer, 0
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return srv

    yield make
    for s in servers:
        s.shutdown()
        s.server_close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _secret_url(port: int) -> str:
    return f"http://alice:hunter2@127.0.0.1:{port}/hooks/SECRET-TOKEN?tok=query-secret"


def _no_secret(text: str) -> None:
    for s in SECRETS:
        assert s not in text, (s, text)


def _deliver(url: str, **kw) -> notify.Delivery:
    t = notify.Target(url, **kw)
    d = notify.Delivery(t.display, "node_drained")
    return notify.post(t, b"{}", d, backoff_s=0.01)


@pytest.mark.parametrize("answer, said", [
    (b"SPAM EGGS\r\n\r\n", "garbage status line"),
    (b"HTTP/1.1 abc Nope\r\n\r\n", "garbage status line"),
    (b"", "closed the connection without an answer"),
])
def test_a_garbage_answer_is_caught_retried_once_and_said(garbage_server, caplog, answer, said):
    srv = garbage_server(answer)
    with caplog.at_level(logging.WARNING, logger="clusterops.notify"):
        d = _deliver(_secret_url(srv.server_address[1]), retries=1, timeout_s=2)
    assert not d.ok and d.attempts == 2 and srv.hits == 2       # one retry, with backoff
    assert said in d.error and "\n" not in d.error
    assert d.error.startswith(f"http://127.0.0.1:{srv.server_address[1]}/...")
    _no_secret(d.error)
    logged = [r.getMessage() for r in caplog.records if r.name == "clusterops.notify"]
    assert logged and said in logged[-1]
    for line in logged:
        _no_secret(line)


def test_a_notifier_with_a_garbage_server_reports_it_not_no_answer(garbage_server):
    srv = garbage_server()
    n = notify.Notifier(notify.parse_targets([{"url": _secret_url(srv.server_address[1])}]), backoff_s=0.01)
    n.send("guard_tripped", "guard", {})
    (d,) = n.close(5)
    assert not d.ok and "garbage status line" in d.error and "no answer" not in d.error
    _no_secret(d.error)


@pytest.mark.parametrize("url, said", [
    ("http://127.0.0.1:99999/hooks/SECRET-TOKEN", "invalid URL"),
    ("http://127.0.0.1:http/hooks/SECRET-TOKEN", "invalid URL"),
    ("http://[::1/hooks/SECRET-TOKEN", "invalid URL"),
    ("http://alice:hunter2@127.0.0.1:1 2/SECRET-TOKEN", "invalid URL"),
])
def test_an_invalid_url_that_slipped_past_validation_never_raises(url, said):
    d = _deliver(url, retries=3)
    assert not d.ok and said in d.error and d.attempts == 1     # final: no retry
    _no_secret(d.error)
    _no_secret(notify.Target(url).display)


def test_refused_timed_out_and_http_status_are_told_apart():
    d = _deliver(_secret_url(closed_port()), retries=0)
    assert "connection refused" in d.error
    _no_secret(d.error)
    slow = Hook(delay_s=2)
    try:
        d = _deliver(slow.url.replace("http://", "http://alice:hunter2@") + "?tok=query-secret",
                     retries=0, timeout_s=0.3)
        assert "timed out after 0.3 s" in d.error
        _no_secret(d.error)
    finally:
        slow.close()
    h = Hook(script=[503, 503])
    try:
        d = _deliver(h.url, retries=1)
        assert not d.ok and d.status == 503 and "HTTP 503" in d.error and d.attempts == 2
        _no_secret(d.error)
    finally:
        h.close()


def test_abandoned_delivery_says_how_far_it_got():
    h = Hook(delay_s=3)
    try:
        n = notify.Notifier(notify.parse_targets([{"url": h.url, "timeout_s": 30, "retries": 0}]))
        n.send("guard_tripped", "guard", {})
        (d,) = n.close(0.3)
        assert "attempt 1 had no answer yet after 0.3 s (timeout 30 s per attempt); abandoned" in d.error
        _no_secret(d.error)
    finally:
        h.close()


def test_default_is_one_retry():
    (t,) = notify.parse_targets(["https://hooks.example/x"])
    assert t.retries == 1


@pytest.mark.parametrize("url", ["http://h:99999/x", "http://h:0/x", "http://h:abc/x", "http://[::1/x",
                                 "http://h/x y", "http://h/\x1b[2Jx"])
def test_bad_urls_are_refused_when_the_config_is_validated(url):
    with pytest.raises(InputError, match=r"notify\[0\]\.url: must be an http:// or https:// URL"):
        notify.parse_targets([{"url": url}])
    assert notify.url_problem(url)


def test_health_profiles_check_refuses_a_webhook_with_a_bad_port(tmp_path, capsys):
    site = tmp_path / "site.yaml"
    site.write_text("notify:\n  - url: https://hooks.example:70000/services/SECRET-TOKEN\n    format: slack\n"
                    "  - http://ok.example/x\n")
    code, out, err = run_cli(capsys, "health", "profiles", "--check", str(site))
    assert code == 2, (out, err)
    assert f"{site}:2" in err and "notify[0].url" in err and "port in 1-65535" in err
    assert "SECRET-TOKEN" not in err and len(err.strip().splitlines()) == 1
    site.write_text("notify:\n  - http://ok.example:8080/x\n  - url: https://ok.example/y\n")
    code, out, err = run_cli(capsys, "health", "profiles", "--check", str(site))
    assert code == 0, err
    site.write_text("notify:\n  - http://bad.example:0/x\n")
    code, out, err = run_cli(capsys, "health", "profiles", "--check", str(site))
    assert code == 2 and "notify[0]" in err


def test_send_never_raises_on_a_payload_it_cannot_encode():
    n = notify.Notifier([notify.Target("http://127.0.0.1:1/x")])
    n.send("node_drained", "x", {"bad": float("nan"), "obj": object()})
    (d,) = n.close(1)
    assert not d.ok and d.error


def test_sweep_events_skip_what_they_cannot_read():
    doc = {"sweep_id": "s1", "applied": [{"action": "drain"}, "garbage", {"action": "drain", "node": "n1"}],
           "plan": {"guard_tripped": True, "actions": ["x", {"why": "guard: y", "node": "n2"}]}}
    events = notify.sweep_events(doc, drain=True)
    assert [e[0] for e in events] == ["node_drained", "guard_tripped"]
    assert events[1][2]["would_drain"] == ["n2"]


def test_job_spec_refuses_a_webhook_with_a_bad_port(tmp_path):
    from clusterops import launch
    from test_launch import BASIC, write_spec

    bad = write_spec(tmp_path, BASIC + "supervise: true\nnotify: [https://hooks.example/x, 'http://h:99999/SECRET-TOKEN']\n")
    with pytest.raises(InputError, match=r"job.yaml:\d+: notify.1: must be an http:// or https:// URL") as e:
        launch.load_spec(bad)
    assert "port in 1-65535" in e.value.message and "SECRET-TOKEN" not in e.value.message
