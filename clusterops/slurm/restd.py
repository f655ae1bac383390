"""slurmrestd's wire: the URL, the JWT that authenticates each request, one JSON round trip,
and which OpenAPI plugin versions a server serves.

``Endpoint`` talks HTTP/1.1 with the standard library (``http.client``): ``http://host:port``,
``https://host:port`` (TLS, ``tls_context``: the server's certificate and name checked against
the CA bundle ``ca_file`` names, else OpenSSL's default verify paths: the system's bundle, or
``$SSL_CERT_FILE``), or the local UNIX socket, ``unix:///path/to/slurmrestd.socket``. One
connection is kept open and opened again when the server has closed it. A certificate that is
refused is a ``SlurmError`` at once (no retry: waiting cannot cure it). Every request carries
slurmrestd's JWT headers, ``X-SLURM-USER-NAME`` and ``X-SLURM-USER-TOKEN``, from a
``TokenSource``:

- ``KeyTokens``: tokens signed here with the cluster's HS256 key (``AuthAltParameters=
  jwt_key=FILE``; readable only by those who may act as any user), for ``lifespan_s`` and
  signed again once a third of that is left;
- ``CommandTokens``: ``scontrol token lifespan=N``, run by the CLI client, asked again once
  a third of the lifespan is left;
- ``StaticToken``: a token handed in (``SLURM_JWT``, as Slurm's own clients take it); it
  cannot be renewed, so one that has expired is a one-line error saying how to get another.

Errors name the URL as ``Endpoint.shown`` spells it: no user, password or query in it, and
never the token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import http.client
import json
import os
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple
from urllib.parse import quote, urlencode, urlsplit

from clusterops.errors import InputError
from clusterops.slurm.api import SlurmError, SlurmUnavailable
from clusterops.slurm.settings import CA_FILE_ENV

TOKEN_ENV = "SLURM_JWT"                     # Slurm's own name for a client's token
KEY_ENV = "CLUSTEROPS_SLURM_JWT_KEY"       # the HS256 key file, where this host may sign
USER_ENV = "CLUSTEROPS_SLURM_USER"         # whom the requests act for (default: this process's user)
DEFAULT_LIFESPAN_S = 1800
_VERSION = re.compile(r"/slurm/(v\d+\.\d+\.\d+)/")


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def sign_token(key: bytes, user: str, now_s: float, lifespan_s: int) -> str:
    """An HS256 JWT as Slurm's auth/jwt takes it: ``iat``, ``exp`` and the user name ``sun``."""
    header = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    body = _b64(json.dumps({"iat": int(now_s), "exp": int(now_s) + int(lifespan_s), "sun": user},
                           separators=(",", ":")).encode())
    mac = hmac.new(key, f"{header}.{body}".encode(), hashlib.sha256).digest()
    return f"{header}.{body}.{_b64(mac)}"


def token_claims(token: str) -> Dict[str, Any]:
    """The payload of a JWT (not verified: the server does that); {} when it is not one."""
    try:
        body = token.split(".")[1]
        return json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (IndexError, ValueError):
        return {}


class TokenSource(Protocol):
    user: str

    def token(self) -> str: ...


@dataclass
class _Renewing:
    """A token kept until a third of its lifespan is left, then fetched again."""

    user: str
    lifespan_s: int
    clock: Callable[[], float]
    _token: Optional[str] = None
    _renew_at: float = 0.0

    def token(self) -> str:
        now = self.clock()
        if self._token is None or now >= self._renew_at:
            self._token = self._fetch(now)
            self._renew_at = now + self.lifespan_s * 2 / 3
        return self._token

    def _fetch(self, now: float) -> str:
        raise NotImplementedError


class KeyTokens(_Renewing):
    """Tokens signed with the cluster's JWT key file."""

    def __init__(self, key_path: str, user: str, lifespan_s: int = DEFAULT_LIFESPAN_S,
                 clock: Callable[[], float] = time.time):
        super().__init__(user, lifespan_s, clock)
        self.key_path = key_path

    def _fetch(self, now: float) -> str:
        try:
            with open(self.key_path, "rb") as f:
                key = f.read()
        except OSError as e:
            raise InputError(f"${KEY_ENV}={self.key_path}: {e.strerror}") from None
        if not key:
            raise InputError(f"${KEY_ENV}={self.key_path}: empty key file")
        return sign_token(key, self.user, now, self.lifespan_s)


class CommandTokens(_Renewing):
    """Tokens from ``scontrol token`` (``fetch(lifespan_s)`` is the CLI client's ``jwt_token``)."""

    def __init__(self, fetch: Callable[[int], str], user: str, lifespan_s: int = DEFAULT_LIFESPAN_S,
                 clock: Callable[[], float] = time.time):
        super().__init__(user, lifespan_s, clock)
        self.fetch = fetch

    def _fetch(self, now: float) -> str:
        return self.fetch(self.lifespan_s)


class StaticToken:
    """A token handed in; refused here once its ``exp`` has passed (it cannot be renewed)."""

    def __init__(self, token: str, user: Optional[str] = None, clock: Callable[[], float] = time.time):
        self._token = token.strip()
        claims = token_claims(self._token)
        self.user = user or str(claims.get("sun") or "")
        self.expires = claims.get("exp")
        self.clock = clock
        if not self.user:
            raise InputError(f"${TOKEN_ENV}: not a Slurm JWT (no user in it): set {USER_ENV}")

    def token(self) -> str:
        if isinstance(self.expires, (int, float)) and self.clock() >= self.expires:
            raise InputError(f"${TOKEN_ENV}: the token expired at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.expires))} "
                             f"UTC: get a new one with `scontrol token lifespan=SECONDS`")
        return self._token


# ------------------------------------------------------------------------------ the wire
class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            s.connect(self.socket_path)
        except OSError:
            s.close()
            raise
        self.sock = s


def check_url(url: str) -> Tuple[str, str, str]:
    """(scheme, where, shown) of a slurmrestd URL; a bad one is a one-line ``InputError``.
    ``where`` is host:port or the socket path; ``shown`` is the URL without secrets."""
    text = (url or "").strip()
    parts = urlsplit(text)
    scheme = parts.scheme.lower()
    if scheme == "unix":
        path = parts.path or parts.netloc
        if not path.startswith("/"):
            raise InputError(f"slurmrestd URL {_shown_of(parts)!r}: a UNIX socket is unix:///absolute/path")
        return scheme, path, f"unix://{path}"
    if scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"slurmrestd URL {_shown_of(parts)!r}: use http://HOST:PORT, https://HOST:PORT "
                         f"or unix:///PATH")
    try:
        port = parts.port or (443 if scheme == "https" else 80)
    except ValueError:
        raise InputError(f"slurmrestd URL {_shown_of(parts)}: bad port") from None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return scheme, f"{host}:{port}", f"{scheme}://{host}:{port}{parts.path.rstrip('/')}"


def _shown_of(parts) -> str:
    """The URL with no user, password, query or fragment in it."""
    netloc = parts.netloc.rpartition("@")[2]
    return f"{parts.scheme}://{netloc}{parts.path}" if parts.scheme else netloc + parts.path


def tls_context(ca_file: Optional[str] = None) -> ssl.SSLContext:
    """The client side of https: certificate and host name checked against ``ca_file`` alone
    when given (the site's CA for slurmrestd), else OpenSSL's default verify paths. A CA file
    that cannot be read is a one-line ``InputError``."""
    if not ca_file:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=ca_file)
    except ssl.SSLError as e:
        raise InputError(f"${CA_FILE_ENV}={ca_file}: no PEM certificate in it ({e.reason})") from None
    except OSError as e:
        raise InputError(f"${CA_FILE_ENV}={ca_file}: {e.strerror}") from None


# What OpenSSL says when the issuer is not trusted here (X509_V_ERR_*): a CA to name.
_UNTRUSTED_ISSUER = {2, 18, 19, 20, 21}


def _refused_certificate(e: ssl.SSLCertVerificationError, ca_file: Optional[str]) -> str:
    why = (e.verify_message or e.reason or "certificate verify failed").rstrip(".")
    if e.verify_code in _UNTRUSTED_ISSUER:
        why += (f": its CA is not in ${CA_FILE_ENV}={ca_file}" if ca_file else
                f": name the CA that signed it with ${CA_FILE_ENV} or the site config's slurm: ca_file")
    return f"the server's TLS certificate was refused ({why})"


@dataclass
class Reply:
    status: int
    body: Dict[str, Any]


class Endpoint:
    """One slurmrestd: ``request`` sends a method and path with the token's headers and
    returns the decoded JSON. Connection failures raise ``SlurmUnavailable``, a refused TLS
    certificate ``SlurmError`` (sent before any request, so no token); what the server
    said is the caller's to judge (``Reply.status``, its ``errors`` list)."""

    def __init__(self, url: str, tokens: TokenSource, *, timeout_s: float = 30.0,
                 ca_file: Optional[str] = None):
        self.scheme, self.where, self.shown = check_url(url)
        self.prefix = urlsplit(url.strip()).path.rstrip("/") if self.scheme != "unix" else ""
        self.tokens = tokens
        self.timeout_s = timeout_s
        self.ca_file = ca_file
        self._tls = tls_context(ca_file) if self.scheme == "https" else None
        self._conn: Optional[http.client.HTTPConnection] = None
        self._lock = threading.Lock()

    def _connect(self) -> http.client.HTTPConnection:
        if self.scheme == "unix":
            return _UnixConnection(self.where, self.timeout_s)
        host, _, port = self.where.rpartition(":")
        host = host.strip("[]")
        if self._tls is not None:
            return http.client.HTTPSConnection(host, int(port), timeout=self.timeout_s, context=self._tls)
        return http.client.HTTPConnection(host, int(port), timeout=self.timeout_s)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None

    def request(self, method: str, path: str, *, query: Optional[Dict[str, str]] = None,
                body: Optional[Dict[str, Any]] = None, auth: bool = True) -> Reply:
        target = self.prefix + "/".join(quote(p, safe="") for p in path.split("/"))
        if query:
            target += "?" + urlencode(query)
        headers = {"Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if auth:
            headers["X-SLURM-USER-NAME"] = self.tokens.user
            headers["X-SLURM-USER-TOKEN"] = self.tokens.token()
        with self._lock:
            for attempt in (0, 1):
                fresh = self._conn is None
                if fresh:
                    self._conn = self._connect()
                try:
                    self._conn.request(method, target, body=data, headers=headers)
                    resp = self._conn.getresponse()
                    raw = resp.read()
                    if resp.getheader("Connection", "").lower() == "close":
                        self._conn.close()
                        self._conn = None
                    break
                except (OSError, http.client.HTTPException) as e:
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                    if isinstance(e, ssl.SSLCertVerificationError):
                        raise SlurmError(f"slurmrestd at {self.shown}: {method} {path}: "
                                         f"{_refused_certificate(e, self.ca_file)}") from None
                    # A kept connection the server closed meanwhile: once more on a new one.
                    if fresh or attempt or isinstance(e, socket.timeout):
                        raise SlurmUnavailable(f"slurmrestd at {self.shown}: {method} {path}: "
                                               f"{type(e).__name__}: {e}".rstrip(": ")) from None
        try:
            decoded = json.loads(raw) if raw.strip() else {}
        except ValueError:
            decoded = {"_text": raw[:200].decode(errors="replace")}
        return Reply(resp.status, decoded if isinstance(decoded, dict) else {"_value": decoded})

    def served_versions(self) -> List[str]:
        """The OpenAPI plugin versions the server serves (``v0.0.38``...), from its own
        description (``GET /openapi/v3``), oldest first."""
        reply = self.request("GET", "/openapi/v3")
        if reply.status != 200:
            raise SlurmError(f"slurmrestd at {self.shown}: GET /openapi/v3: HTTP {reply.status} "
                             f"{error_text(reply.body) or ''}".rstrip())
        paths = reply.body.get("paths") if isinstance(reply.body, dict) else None
        found = {m.group(1) for p in (paths or {}) for m in [_VERSION.match(p + "/")] if m}
        return sorted(found, key=version_key)


def version_key(v: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in v.lstrip("v").split("."))


def error_text(body: Dict[str, Any]) -> str:
    """The server's ``errors`` list as one line (22.05 says ``error``/``description``; the
    v0.0.4x plugins also ``source``)."""
    out = []
    for e in body.get("errors") or []:
        if isinstance(e, dict):
            words = [str(e.get(k)) for k in ("error", "description") if e.get(k)]
            if words:
                out.append(": ".join(dict.fromkeys(words)))
    if not out and body.get("_text"):
        out.append(str(body["_text"]).strip().splitlines()[0] if str(body["_text"]).strip() else "")
    return "; ".join(x for x in out if x).replace("\n", " ")


def error_numbers(body: Dict[str, Any]) -> List[int]:
    nums = []
    for e in body.get("errors") or []:
        if isinstance(e, dict):
            n = e.get("error_number", e.get("errno"))
            if isinstance(n, int):
                nums.append(n)
    return nums


def current_user() -> str:
    import pwd

    return os.environ.get(USER_ENV) or pwd.getpwuid(os.geteuid()).pw_name
