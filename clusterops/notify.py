"""Notifications: webhooks told what clusterops did, never holding it up.

A target is a webhook URL with a payload format: ``json`` (a generic JSON POST) or
``slack`` (Slack-compatible ``{"text": ...}``, which Mattermost and Rocket.Chat accept
too). Configured as ``notify:`` in the health site config or a file given to the sweep's
``--notify-config``::

    notify:
      - url: https://hooks.slack.com/services/T000/B000/XXXX
        format: slack
        events: [node_drained, guard_tripped, sweep_cannot_run]   # default: every event
        timeout_s: 5          # per attempt (default 5)
        retries: 1            # more attempts after the first (default 1), with backoff

Who sends what: the sweep ``node_drained``, ``node_resumed``, ``guard_tripped`` and
``sweep_cannot_run``; ``health check --drain-on-fail`` (the site config's ``notify:``)
``node_drained``, ``node_resumed`` and ``guard_tripped`` for its own node; the supervisor
``job_requeued``, ``job_given_up`` (with the exit code, the program's last error line and the timeline's summary),
``job_rolled_back`` (a stability rollback: to which step, what is skipped), ``job_diverged``
(the stability guard stopped the job or gave up; instead of ``job_given_up``) and
``job_node_drained`` (a node of the job drained by someone else: replaced or kept) to the
site config's webhooks and to the job spec's ``notify:`` URLs (generic JSON). Every send runs on its own daemon thread: :meth:`Notifier.send`
returns at once, :meth:`Notifier.close` waits for the deliveries at most ``max_wait_s`` in
all, and a webhook that is down, slow or refusing only yields a one-line ``error`` in
the delivery record and the log (the URL shown as scheme, host and port only: its
path, query and userinfo often hold the secret). That line says what happened: refused,
timed out, an HTTP status, a garbage answer, a bad URL. :func:`post` and
:meth:`Notifier.send` never raise, so the drain, report, history or metrics file that
follows a notification is written whatever the webhook does. A URL with a bad port (or
any URL ``urlsplit`` cannot read) is refused when the config is validated
(:func:`url_problem`, used by the site config's schema and :func:`parse_targets`).
"""

from __future__ import annotations

from pathlib import Path

import http.client
import json
import logging
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence
from urllib.parse import urlsplit

from clusterops.errors import InputError

FORMATS = ("json", "slack")
EVENTS = ("node_drained", "node_resumed", "guard_tripped", "sweep_cannot_run", "job_given_up", "job_requeued", "job_rolled_back", "job_diverged",
          "job_node_drained")
TARGET_KEYS = {"url", "format", "events", "timeout_s", "retries"}
MAX_RETRIES = 10
DEFAULT_RETRIES = 1

log = logging.getLogger(__name__)


def url_problem(url: Any) -> Optional[str]:
    """Why url cannot be a webhook (None when it can): http(s), a host, a port in
    1-65535 when one is given, no spaces or control characters."""
    if not isinstance(url, str) or not url.strip():
        return "must be an http:// or https:// URL"
    if any(ord(c) <= 0x20 or 0x7f <= ord(c) <= 0x9f for c in url):
        return "must be an http:// or https:// URL without spaces or control characters"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "must be an http:// or https:// URL with a valid host and a port in 1-65535"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "must be an http:// or https:// URL"
    if port == 0:
        return "must be an http:// or https:// URL with a port in 1-65535"
    return None


def display_url(url: str) -> str:
    """scheme://host:port/... : the URL without userinfo, path, query or fragment (a
    webhook's secret usually lives there). Never raises."""
    try:
        p = urlsplit(url)
        host = p.hostname or ""
    except (ValueError, TypeError, AttributeError):
        return "<webhook URL>"
    try:
        port = p.port
    except ValueError:
        port = None
    if ":" in host:
        host = f"[{host}]"
    scheme = p.scheme if p.scheme in ("http", "https") else "?"
    return f"{scheme}://{host}{':' + str(port) if port else ''}/..."


def _scrub(text: str, url: str) -> str:
    """text without any secret-bearing part of url (whole, path, query, userinfo)."""
    try:
        p = urlsplit(url)
        parts = [url, p.path, p.query, p.fragment, p.netloc.rpartition("@")[0] if "@" in p.netloc else ""]
    except (ValueError, TypeError, AttributeError):
        parts = [url]
    for piece in sorted((x for x in parts if x and len(x) > 1), key=len, reverse=True):
        text = text.replace(piece, "...")
    return text


def describe_error(e: BaseException, timeout_s: float, url: str = "") -> str:
    """What went wrong with one attempt, in words: refused, timed out, HTTP status, ..."""
    if isinstance(e, urllib.error.HTTPError):
        return f"HTTP {e.code}"
    reason = e.reason if isinstance(e, urllib.error.URLError) and isinstance(e.reason, BaseException) else e
    if isinstance(reason, (socket.timeout, TimeoutError)):
        return f"timed out after {timeout_s:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return "connection refused"
    if isinstance(reason, http.client.RemoteDisconnected):
        return "the server closed the connection without an answer"
    if isinstance(reason, ConnectionResetError):
        return "connection reset by the server"
    if isinstance(reason, socket.gaierror):
        return "host name not resolved"
    if isinstance(reason, ssl.SSLError):
        return f"TLS error ({getattr(reason, 'reason', None) or type(reason).__name__})"
    if isinstance(reason, (http.client.InvalidURL, ValueError)):
        return "invalid URL"
    if isinstance(reason, http.client.BadStatusLine):
        return "bad HTTP answer (garbage status line)"
    if isinstance(reason, http.client.HTTPException):
        return f"bad HTTP answer ({type(reason).__name__})"
    text = " ".join(str(getattr(e, "reason", e)).split())
    return _scrub(f"{type(reason).__name__}: {text}" if text else type(reason).__name__, url)[:200]


def _final(e: BaseException) -> bool:
    """An error that a second attempt cannot cure."""
    if isinstance(e, urllib.error.HTTPError):
        return 400 <= e.code < 500 and e.code != 429
    reason = e.reason if isinstance(e, urllib.error.URLError) else e
    return isinstance(reason, (http.client.InvalidURL, ValueError)) and not isinstance(reason, OSError)


@dataclass(frozen=True)
class Target:
    url: str
    format: str = "json"
    events: Optional[frozenset] = None      # None: every event
    timeout_s: float = 5.0
    retries: int = DEFAULT_RETRIES

    @property
    def display(self) -> str:
        """The URL without userinfo, path and query (a webhook's secret usually lives there)."""
        return display_url(self.url)

    def wants(self, event: str) -> bool:
        return self.events is None or event in self.events


def parse_targets(items: Any, source: str = "notify") -> List[Target]:
    """The ``notify:`` list -> targets; anything wrong is an InputError naming the entry."""
    if items is None:
        return []
    if not isinstance(items, list):
        raise InputError(f"{source}: must be a list of webhooks (each with url:)")
    out = []
    for i, item in enumerate(items):
        at = f"{source}[{i}]"
        if isinstance(item, str):
            item = {"url": item}
        if not isinstance(item, Mapping):
            raise InputError(f"{at}: must be a mapping with url: (and format:, events:, timeout_s:, retries:)")
        for k in item:
            if k not in TARGET_KEYS:
                raise InputError(f"{at}.{k}: unknown key; valid: {', '.join(sorted(TARGET_KEYS))}")
        url = item.get("url")
        why = url_problem(url)
        if why is not None:
            raise InputError(f"{at}.url: {why}")
        fmt = item.get("format", "json")
        if fmt not in FORMATS:
            raise InputError(f"{at}.format: must be one of {', '.join(FORMATS)}, got {fmt!r}")
        events = item.get("events")
        if events is not None:
            if not isinstance(events, list) or not all(isinstance(e, str) for e in events):
                raise InputError(f"{at}.events: must be a list of event names")
            unknown = [e for e in events if e not in EVENTS]
            if unknown:
                raise InputError(f"{at}.events: unknown event {unknown[0]!r}; valid: {', '.join(EVENTS)}")
            events = frozenset(events)
        timeout_s = item.get("timeout_s", 5.0)
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0.1 <= timeout_s <= 60:
            raise InputError(f"{at}.timeout_s: must be a number of seconds in [0.1, 60], got {timeout_s!r}")
        retries = item.get("retries", DEFAULT_RETRIES)
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= MAX_RETRIES:
            raise InputError(f"{at}.retries: must be a whole number in [0, {MAX_RETRIES}], got {retries!r}")
        out.append(Target(url, fmt, events, float(timeout_s), retries))
    return out


def load_config(path: Optional[str]) -> List[Target]:
    """Targets from a YAML file's ``notify:`` key (a health site config, or a file of
    its own); [] without a file."""
    if not path:
        return []
    from clusterops import yamlio   # the one loader: no aliases, bounded size, lines in errors

    data, _ = yamlio.load_file(Path(path), "notify config")
    if data is None:
        return []
    if not isinstance(data, Mapping):
        raise InputError(f"{path}: must be a mapping (with a notify: list)")
    return parse_targets(data.get("notify"), f"{path}: notify")


def payload(target: Target, event: str, summary: str, details: Mapping[str, Any], when: float) -> bytes:
    from clusterops.jsonout import clean

    if target.format == "slack":
        lines = [f"*clusterops* `{event}` on {socket.gethostname()}: {summary}"]
        for k, v in details.items():
            if v not in (None, "", [], {}):
                lines.append(f"• {k}: {v if not isinstance(v, (list, tuple)) else ', '.join(map(str, v))}")
        doc: Dict[str, Any] = {"text": "\n".join(lines)}
    else:
        doc = {"source": "clusterops", "event": event, "summary": summary, "host": socket.gethostname(),
               "time": when, "time_iso": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)),
               "details": dict(details)}
    return json.dumps(clean(doc), allow_nan=False).encode()


@dataclass
class Delivery:
    target: str
    event: str
    ok: bool = False
    attempts: int = 0
    status: Optional[int] = None
    error: Optional[str] = None

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def post(target: Target, body: bytes, delivery: Delivery, *, backoff_s: float = 0.5,
         stop: Optional[threading.Event] = None) -> Delivery:
    """POST with retries (on connection errors, timeouts, garbage answers, 429 and 5xx;
    a 4xx other than 429 and an invalid URL are final) and exponential backoff.

    Never raises: every failure (also a garbage status line or a URL that http.client
    refuses) ends up in ``delivery.error`` as one line that says what happened and shows
    the URL without its path, query or userinfo; a final failure is logged the same way.
    """
    try:
        _post(target, body, delivery, backoff_s, stop)
    except Exception as e:  # noqa: BLE001 - a webhook must never break the path that sends it
        delivery.ok = False
        delivery.error = f"{target.display}: {describe_error(e, target.timeout_s, target.url)}"
    if not delivery.ok:
        log.warning("webhook %s not delivered to %s after %d attempt(s): %s", delivery.event, target.display,
                    delivery.attempts, delivery.error)
    return delivery


def _request_parts(url: str) -> tuple:
    """(URL without userinfo, headers): userinfo becomes HTTP basic auth, as curl does
    (urllib would take ``user:pass@host`` for a host name)."""
    headers = {"Content-Type": "application/json", "User-Agent": "clusterops"}
    parts = urlsplit(url)
    if "@" in parts.netloc:
        import base64
        from urllib.parse import unquote, urlunsplit

        userinfo, _, hostport = parts.netloc.rpartition("@")
        user, _, password = userinfo.partition(":")
        token = base64.b64encode(f"{unquote(user)}:{unquote(password)}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
        url = urlunsplit((parts.scheme, hostport, parts.path, parts.query, parts.fragment))
    return url, headers


def _post(target: Target, body: bytes, delivery: Delivery, backoff_s: float,
          stop: Optional[threading.Event]) -> None:
    if url_problem(target.url) is not None:
        # Never sent: http.client would take port 99999 modulo 65536, another port.
        delivery.attempts = 1
        delivery.error = f"{target.display}: invalid URL (not sent)"
        return
    for attempt in range(target.retries + 1):
        if stop is not None and stop.is_set():
            delivery.error = (delivery.error or f"{target.display}: not sent") + " (abandoned: clusterops was exiting)"
            return
        delivery.attempts = attempt + 1
        try:
            url, headers = _request_parts(target.url)
            req = urllib.request.Request(url, data=body, method="POST", headers=headers)
            with urllib.request.urlopen(req, timeout=target.timeout_s) as resp:   # noqa: S310 (http(s) only)
                delivery.status = resp.status
                delivery.ok, delivery.error = True, None
                return
        except Exception as e:  # noqa: BLE001 - classified below, never raised
            if isinstance(e, urllib.error.HTTPError):
                delivery.status = e.code
            delivery.error = f"{target.display}: {describe_error(e, target.timeout_s, target.url)}" + (
                f" (attempt {attempt + 1} of {target.retries + 1})" if target.retries else "")
            if _final(e):
                return
        if attempt < target.retries:
            wait = backoff_s * (2 ** attempt)
            if stop is not None:
                if stop.wait(wait):
                    continue
            else:
                time.sleep(wait)


class Notifier:
    """Sends events to its targets in the background. Use :meth:`send` as often as
    needed, then :meth:`close` once."""

    def __init__(self, targets: Sequence[Target], *, backoff_s: float = 0.5, clock=time.time):
        self.targets = list(targets)
        self.backoff_s = backoff_s
        self.clock = clock
        self.deliveries: List[Delivery] = []
        self._threads: List[threading.Thread] = []
        self._targets_of: Dict[int, Target] = {}
        self._stop = threading.Event()

    def send(self, event: str, summary: str, details: Optional[Mapping[str, Any]] = None) -> None:
        """Start the deliveries of one event; returns at once and never raises."""
        for t in self.targets:
            if not t.wants(event):
                continue
            d = Delivery(t.display, event)
            self.deliveries.append(d)
            try:
                body = payload(t, event, summary, details or {}, self.clock())
                th = threading.Thread(target=post, args=(t, body, d), kwargs={"backoff_s": self.backoff_s,
                                                                              "stop": self._stop},
                                      name=f"clusterops-notify-{event}", daemon=True)
                th.start()
            except Exception as e:  # noqa: BLE001 - a bad payload or no thread: recorded, never raised
                d.error = f"{t.display}: not sent ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
                log.warning("webhook %s not sent to %s: %s", event, t.display, d.error)
                continue
            self._threads.append(th)
            self._targets_of[id(d)] = t

    def close(self, max_wait_s: float = 10.0) -> List[Delivery]:
        """Wait for the deliveries, at most ``max_wait_s`` in all; those still running are
        abandoned (daemon threads: they never keep the process alive)."""
        deadline = time.monotonic() + max(0.0, max_wait_s)
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        for d, th in zip([d for d in self.deliveries if id(d) in self._targets_of], self._threads):
            if d.ok or not th.is_alive():
                continue
            t = self._targets_of[id(d)]
            if d.error is None:
                d.error = (f"{d.target}: attempt {d.attempts or 1} had no answer yet after {max_wait_s:g} s "
                           f"(timeout {t.timeout_s:g} s per attempt); abandoned")
            else:
                d.error += f"; abandoned after {max_wait_s:g} s while retrying"
            log.warning("webhook %s to %s abandoned: %s", d.event, d.target, d.error)
        return self.deliveries

    def failures(self) -> List[Delivery]:
        return [d for d in self.deliveries if not d.ok]


def sweep_events(doc: Mapping[str, Any], drain: bool) -> List[tuple]:
    """(event, summary, details) for a finished sweep's report document. Entries it cannot
    read are skipped: telling a webhook never stops the report from being written."""
    out = []
    sid = doc.get("sweep_id")
    for a in doc.get("applied") or []:
        if not isinstance(a, Mapping) or not a.get("node"):
            continue
        if a.get("action") == "drain":
            out.append(("node_drained", f"{a['node']} drained: {a.get('reason') or ''}".rstrip(": "),
                        {"node": a["node"], "reason": a.get("reason"), "sweep_id": sid}))
        elif a.get("action") == "resume":
            out.append(("node_resumed", f"{a['node']} resumed: its check passes again",
                        {"node": a["node"], "sweep_id": sid}))
    plan = doc.get("plan") or {}
    if drain and isinstance(plan, Mapping) and plan.get("guard_tripped"):
        would = [a.get("node") for a in plan.get("actions") or []
                 if isinstance(a, Mapping) and str(a.get("why", "")).startswith("guard:")]
        out.append(("guard_tripped", plan.get("message") or "sweep safety guard tripped: no node drained",
                    {"would_drain": would, "sweep_id": sid}))
    return out
