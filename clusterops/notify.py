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
        retries: 2            # more attempts after the first (default 2), with backoff

Who sends what: the sweep ``node_drained``, ``node_resumed``, ``guard_tripped`` and
``sweep_cannot_run``; ``health check --drain-on-fail`` (the site config's ``notify:``)
``node_drained``, ``node_resumed`` and ``guard_tripped`` for its own node; the supervisor
``job_requeued`` and ``job_given_up`` (with the exit code and the timeline's summary) to the
site config's webhooks and to the job spec's ``notify:`` URLs (generic JSON). Every send runs on its own daemon thread: :meth:`Notifier.send`
returns at once, :meth:`Notifier.close` waits for the deliveries at most ``max_wait_s`` in
all, and a webhook that is down, slow or refusing only yields a one-line ``error`` in
the delivery record (the URL shown without its path, which often holds the secret).
"""

from __future__ import annotations

from pathlib import Path

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence
from urllib.parse import urlsplit

from clusterops.errors import InputError

FORMATS = ("json", "slack")
EVENTS = ("node_drained", "node_resumed", "guard_tripped", "sweep_cannot_run", "job_given_up", "job_requeued")
TARGET_KEYS = {"url", "format", "events", "timeout_s", "retries"}
MAX_RETRIES = 10


@dataclass(frozen=True)
class Target:
    url: str
    format: str = "json"
    events: Optional[frozenset] = None      # None: every event
    timeout_s: float = 5.0
    retries: int = 2

    @property
    def display(self) -> str:
        """The URL without its path and query (a webhook's secret usually lives there)."""
        p = urlsplit(self.url)
        host = p.hostname or ""
        return f"{p.scheme}://{host}{':' + str(p.port) if p.port else ''}/..."

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
        if not isinstance(url, str) or urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise InputError(f"{at}.url: must be an http:// or https:// URL")
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
        retries = item.get("retries", 2)
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
    """POST with retries (on connection errors, timeouts, 429 and 5xx; a 4xx other than
    429 is final) and exponential backoff. Never raises."""
    for attempt in range(target.retries + 1):
        if stop is not None and stop.is_set():
            delivery.error = (delivery.error or "") + " (abandoned: clusterops was exiting)"
            break
        delivery.attempts = attempt + 1
        req = urllib.request.Request(target.url, data=body, method="POST",
                                     headers={"Content-Type": "application/json", "User-Agent": "clusterops"})
        try:
            with urllib.request.urlopen(req, timeout=target.timeout_s) as resp:   # noqa: S310 (http(s) only)
                delivery.status = resp.status
                delivery.ok, delivery.error = True, None
                return delivery
        except urllib.error.HTTPError as e:
            delivery.status = e.code
            delivery.error = f"{target.display}: HTTP {e.code}"
            if 400 <= e.code < 500 and e.code != 429:
                return delivery
        except (urllib.error.URLError, OSError, ValueError) as e:
            reason = getattr(e, "reason", e)
            delivery.error = f"{target.display}: {' '.join(str(reason).split())[:200] or type(e).__name__}"
        if attempt < target.retries:
            wait = backoff_s * (2 ** attempt)
            if stop is not None:
                if stop.wait(wait):
                    continue
            else:
                time.sleep(wait)
    return delivery


class Notifier:
    """Sends events to its targets in the background. Use :meth:`send` as often as
    needed, then :meth:`close` once."""

    def __init__(self, targets: Sequence[Target], *, backoff_s: float = 0.5, clock=time.time):
        self.targets = list(targets)
        self.backoff_s = backoff_s
        self.clock = clock
        self.deliveries: List[Delivery] = []
        self._threads: List[threading.Thread] = []
        self._stop = threading.Event()

    def send(self, event: str, summary: str, details: Optional[Mapping[str, Any]] = None) -> None:
        for t in self.targets:
            if not t.wants(event):
                continue
            d = Delivery(t.display, event)
            self.deliveries.append(d)
            try:
                body = payload(t, event, summary, details or {}, self.clock())
            except (TypeError, ValueError) as e:
                d.error = f"payload: {e}"
                continue
            th = threading.Thread(target=post, args=(t, body, d), kwargs={"backoff_s": self.backoff_s,
                                                                          "stop": self._stop},
                                  name=f"clusterops-notify-{event}", daemon=True)
            th.start()
            self._threads.append(th)

    def close(self, max_wait_s: float = 10.0) -> List[Delivery]:
        """Wait for the deliveries, at most ``max_wait_s`` in all; those still running are
        abandoned (daemon threads: they never keep the process alive)."""
        deadline = time.monotonic() + max(0.0, max_wait_s)
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        for d in self.deliveries:
            if not d.ok and d.error is None:
                d.error = f"{d.target}: no answer within {max_wait_s:g} s (abandoned)"
        return self.deliveries

    def failures(self) -> List[Delivery]:
        return [d for d in self.deliveries if not d.ok]


def sweep_events(doc: Mapping[str, Any], drain: bool) -> List[tuple]:
    """(event, summary, details) for a finished sweep's report document."""
    out = []
    sid = doc.get("sweep_id")
    for a in doc.get("applied", []):
        if a.get("action") == "drain":
            out.append(("node_drained", f"{a['node']} drained: {a.get('reason') or ''}".rstrip(": "),
                        {"node": a["node"], "reason": a.get("reason"), "sweep_id": sid}))
        elif a.get("action") == "resume":
            out.append(("node_resumed", f"{a['node']} resumed: its check passes again",
                        {"node": a["node"], "sweep_id": sid}))
    plan = doc.get("plan") or {}
    if drain and plan.get("guard_tripped"):
        would = [a["node"] for a in plan.get("actions", []) if str(a.get("why", "")).startswith("guard:")]
        out.append(("guard_tripped", plan.get("message") or "sweep safety guard tripped: no node drained",
                    {"would_drain": would, "sweep_id": sid}))
    return out
