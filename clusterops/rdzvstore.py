"""The in-process rendezvous's store, as both sides use it: every value sealed with the job's secret.

torch's ``TCPStore`` trusts whoever connects: any client can list every key
(``list_keys()``), read any value, overwrite it, delete it, bump a counter. The in-process
rendezvous (:mod:`clusterops.supervisor.rendezvous` hosts it, :mod:`clusterops.recover` is the
ranks' side) therefore never relies on a key being secret. Instead every value either side
writes is *sealed*: encrypted and authenticated with keys derived from a per-attempt secret
that only the job's processes hold (the ``TOKEN`` of ``HOST:PORT/TOKEN`` in
:data:`clusterops.protocol.ENV_RDZV_ADDR`: the environment of the job's own processes, and
the 0600 ``command.txt``; the secret itself is never written into the store, whose keys live
under a prefix derived from it).

- **Sealing** (:class:`Sealer`): a fresh 16-byte nonce, the value XORed with a keystream
  (SHAKE-256 of the encryption key and the nonce), then HMAC-SHA256 over the key's name, the
  nonce and the ciphertext. A value is bound to its key: a sealed ``plan/3`` copied to
  ``plan/4`` does not open. Opening checks the tag (constant-time) first and returns None for
  anything else: forged, cut, copied, or written by a stranger.
- **The store torch sees** (:func:`sealed_store`): a ``torch.distributed.Store`` subclass over
  the TCPStore, so ``init_process_group`` forms the generation's group on sealed values too:
  gloo's listening addresses and NCCL's unique id cannot be read or forged by a stranger. A
  ``get`` that finds a value that does not open waits for one that does (until the store's
  timeout): a forgery delays, it never steers.
- **What cannot be sealed**: a counter (``add``: the server does the arithmetic). The
  rendezvous uses counters only as hints (``rep/n``: where the next report may be; a bumped
  counter leaves gaps the host skips), never for a decision; "the first to say so" is a
  ``compare_set`` of a sealed value instead (:meth:`SealedStore.first`).

A stranger who reaches the port can still delete or overwrite values (a sealed value it
replaced is lost): that delays a recovery until its timeout, and the supervisor's relaunch
follows. Standard library only at import: torch is imported when a store is made.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import time
from typing import Any, Iterable, List, Optional, Sequence, Tuple

NONCE_BYTES = 16
TAG_BYTES = 32
SECRET_BYTES = 32
RETRY_S = 0.01


def new_secret() -> str:
    """A fresh per-attempt secret (hex), what ``HOST:PORT/TOKEN`` carries as TOKEN."""
    return secrets.token_hex(SECRET_BYTES)


def _xor(data: bytes, stream: bytes) -> bytes:
    if not data:
        return b""
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream, "big")).to_bytes(len(data), "big")


class Sealer:
    """Seals and opens values for one secret (see the module)."""

    def __init__(self, secret: str):
        if not secret:
            raise ValueError("the rendezvous secret is empty")
        root = secret.encode()
        self._enc = hmac.new(root, b"clusterops-rdzv-enc", hashlib.sha256).digest()
        self._mac = hmac.new(root, b"clusterops-rdzv-mac", hashlib.sha256).digest()
        #: the store's key prefix: derived, so the secret never appears in the store
        self.prefix = hmac.new(root, b"clusterops-rdzv-prefix", hashlib.sha256).hexdigest()[:24]

    def _tag(self, key: str, nonce: bytes, body: bytes) -> bytes:
        k = key.encode()
        return hmac.new(self._mac, len(k).to_bytes(4, "big") + k + nonce + body, hashlib.sha256).digest()

    def seal(self, key: str, value: Any) -> bytes:
        data = value.encode() if isinstance(value, str) else bytes(value)
        nonce = os.urandom(NONCE_BYTES)
        body = _xor(data, hashlib.shake_256(self._enc + nonce).digest(len(data)))
        return nonce + body + self._tag(key, nonce, body)

    def open(self, key: str, blob: Optional[bytes]) -> Optional[bytes]:
        """The value sealed under ``key``; None when ``blob`` is not one (never raises)."""
        if blob is None:
            return None
        blob = bytes(blob)
        if len(blob) < NONCE_BYTES + TAG_BYTES:
            return None
        nonce, body, tag = blob[:NONCE_BYTES], blob[NONCE_BYTES:-TAG_BYTES], blob[-TAG_BYTES:]
        if not hmac.compare_digest(tag, self._tag(key, nonce, body)):
            return None
        return _xor(body, hashlib.shake_256(self._enc + nonce).digest(len(body)))

    def seal_line(self, key: str, text: str) -> str:
        """One sealed record for an append-only key: base64, no newline inside."""
        return base64.b64encode(self.seal(key, text)).decode() + "\n"

    def open_lines(self, key: str, raw: bytes) -> List[str]:
        """The records of ``raw`` (whole lines) that open under ``key``; the rest is dropped."""
        out = []
        for line in raw.split(b"\n"):
            if not line:
                continue
            try:
                blob = base64.b64decode(line, validate=True)
            except ValueError:
                continue
            value = self.open(key, blob)
            if value is not None:
                out.append(value.decode(errors="replace"))
        return out


class SealedStore:
    """The rendezvous's view of the store: sealed values under the derived prefix. ``raw`` is the
    PrefixStore (for counters); :attr:`torch_store` the ``dist.Store`` that forms process groups."""

    def __init__(self, tcp: Any, sealer: Sealer, timeout_s: float):
        import torch.distributed as dist

        self.tcp = tcp
        self.sealer = sealer
        self.timeout_s = float(timeout_s)
        self.raw = dist.PrefixStore(sealer.prefix, tcp)
        self.torch_store = sealed_store(self.raw, sealer, timeout_s)

    # values
    def set(self, key: str, value: Any) -> None:
        self.raw.set(key, self.sealer.seal(key, value))

    def peek(self, key: str) -> Optional[bytes]:
        """The value of ``key`` when it is there and opens; None otherwise (no wait)."""
        if not self.raw.check([key]):
            return None
        return self.sealer.open(key, self.raw.get(key))

    def peek_many(self, keys: Sequence[str]) -> List[Optional[bytes]]:
        """``peek`` for keys that all exist (one round trip); a value that does not open is None."""
        return [self.sealer.open(k, v) for k, v in zip(keys, self.raw.multi_get(list(keys)))]

    def exists(self, keys: Sequence[str]) -> bool:
        return bool(self.raw.check(list(keys)))

    def first(self, key: str, value: Any) -> bool:
        """Set ``key`` only if nobody did: True when this caller's value is the one there, or when
        what is there does not open (a stranger's: the caller acts as if it were first)."""
        mine = self.sealer.seal(key, value)
        there = self.raw.compare_set(key, "", mine)
        return bytes(there) == mine or self.sealer.open(key, there) is None

    # append-only records
    def append(self, key: str, text: str) -> None:
        self.raw.append(key, self.sealer.seal_line(key, text))

    # counters (not sealed: hints only)
    def add(self, key: str, n: int) -> int:
        return int(self.raw.add(key, n))


def sealed_store(inner: Any, sealer: Sealer, timeout_s: float) -> Any:
    """A ``torch.distributed.Store`` over ``inner`` whose values are sealed (for
    ``init_process_group(store=...)``): what torch writes is sealed, what it reads must open."""
    import datetime

    import torch.distributed as dist

    class _Sealed(dist.Store):
        def __init__(self) -> None:
            super().__init__()
            self._timeout = datetime.timedelta(seconds=timeout_s)

        def set(self, key: str, value: Any) -> None:
            inner.set(key, sealer.seal(key, value))

        def get(self, key: str) -> bytes:
            end = time.monotonic() + self._timeout.total_seconds()
            while True:
                value = sealer.open(key, inner.get(key))
                if value is not None:
                    return value
                if time.monotonic() >= end:   # a stranger's value never replaced by ours
                    raise dist.DistStoreError(f"rendezvous key {key!r}: no authentic value within "
                                              f"{self._timeout.total_seconds():.0f} s")
                time.sleep(RETRY_S)

        def multi_get(self, keys: List[str]) -> List[bytes]:
            return [self.get(k) for k in keys]

        def multi_set(self, keys: List[str], values: List[Any]) -> None:
            for k, v in zip(keys, values):
                self.set(k, v)

        def add(self, key: str, value: int) -> int:
            return inner.add(key, value)

        def check(self, keys: List[str]) -> bool:
            return inner.check(keys)

        def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
            inner.wait(keys, timeout if timeout is not None else self._timeout)

        def delete_key(self, key: str) -> bool:
            return inner.delete_key(key)

        def num_keys(self) -> int:
            return inner.num_keys()

        def set_timeout(self, timeout: datetime.timedelta) -> None:
            self._timeout = timeout

        def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
            raise NotImplementedError("compare_set on the sealed rendezvous store")

    return _Sealed()


def connect(addr: str, timeout_s: float) -> SealedStore:
    """A client's sealed view of the rendezvous at ``HOST:PORT/TOKEN``."""
    import datetime

    import torch.distributed as dist

    from clusterops import protocol

    host, port, secret = protocol.parse_rdzv_addr(addr)
    tcp = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    return SealedStore(tcp, Sealer(secret), timeout_s)


def group_tags(sealer: Sealer, gen: int, world: int) -> List[bytes]:
    """What each rank of generation ``gen`` proves it holds the secret with, once its group is
    formed (:func:`clusterops.recover._verify_group`): rank r's tag, 16 bytes each."""
    return [hmac.new(sealer._mac, f"pg-verify/{int(gen)}/{int(world)}/{r}".encode(), hashlib.sha256).digest()[:16]
            for r in range(int(world))]


def lines_of(raw: bytes, start: int) -> Tuple[bytes, int]:
    """The whole lines of an append-only value from byte ``start``, and where they end."""
    end = raw.rfind(b"\n") + 1
    if end <= start:
        return b"", start
    return raw[start:end], end

