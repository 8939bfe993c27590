"""Signed msgpack envelopes (never pickle) and replay protection.

On the wire a message is three ZeroMQ frames: `header`, `mac`, `body` (protocol 4).
    body   = msgpack(the message's fields)
    header = msgpack([kind, client_id, seq, ts, len(body), SHA-256(body)])
    mac    = HMAC-SHA256(run secret, header)
The signature covers a header of about a hundred bytes, which covers the body through its
length and digest. So a frame with a wrong signature costs the receiver an HMAC of the
header, whatever the size of the body: with one HMAC over a whole payload, frames just under
the size limit (60 MB) cost 50 ms each before they could be refused, and a peer without the
secret stalled a correct client for seconds. The body is hashed only once the header has
verified and is fresh; a body that does not match its header is refused (`unauthorized`).
`client_id` is 16 random bytes chosen by each client at start, `seq` strictly increases per
client, `ts` is the sender's wall clock. The receiver accepts a request only if the MAC
verifies, `ts` is a finite number within `max_skew_s` of its own clock and not before
`not_before`, and `seq` is above the last one seen from that client; a replayed or
re-ordered copy of a signed message is therefore refused, and the per-client table only
needs to remember clients seen within the skew window. That table lives in memory: the
dataflow rank sets `not_before` to its start time (less a small slack), so a message
captured before a restart is not accepted after it; it is dropped unanswered, and an honest
client's retry, signed afresh, goes through.
Replies carry the request's client_id and seq and are signed the same way; a client drops a
reply that fails verification (`try_reply`), counting it by reason in `dropped`.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import math
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import msgpack

from astraflow.protocol import messages
from astraflow.protocol.wire import WireError, decode, encode

log = logging.getLogger(__name__)

MAX_HEADER_BYTES = 512  # a header is ~100 bytes; anything longer is refused before the HMAC
Buffer = bytes | memoryview  # a body may be a view of a received frame (the rank does not copy it)


class Reject(Exception):
    """An incoming message that is refused. `reply` says whether the sender gets an answer."""

    def __init__(self, code: str, message: str, reply: bool = True,
                 client_id: bytes = b"", seq: int = 0) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.reply = code, message, reply
        self.client_id, self.seq = client_id, seq


class RemoteError(RuntimeError):
    """The peer answered with an Error reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class Envelope:
    kind: str
    client_id: bytes
    seq: int
    ts: float
    body: Any


class Codec:
    def __init__(self, secret: bytes, max_bytes: int = 64 << 20, max_skew_s: float = 300.0,
                 not_before: float = -math.inf) -> None:
        if len(secret) < 16:
            raise ValueError("run secret must be at least 16 bytes")
        self._secret = secret
        self.max_bytes = max_bytes
        self.max_skew_s = max_skew_s
        self.not_before = not_before  # wall clock: requests signed earlier are dropped
        self.dropped: Counter[str] = Counter()  # replies dropped by `try_reply`, by reason
        self._last_seq: dict[bytes, tuple[int, float]] = {}
        self._next_prune = 0.0

    # -------------------------------------------------------------- sending
    def pack(self, msg: Any, client_id: bytes, seq: int, kind: str | None = None) -> list[bytes]:
        kind = kind or type(msg).__name__.lower()
        return self.seal(kind, client_id, seq, time.time(), msgpack.packb(encode(msg), use_bin_type=True))

    def seal(self, kind: str, client_id: bytes, seq: int, ts: float, body: bytes) -> list[bytes]:
        """The three signed frames of an already packed body."""
        header = msgpack.packb([kind, client_id, seq, ts, len(body), hashlib.sha256(body).digest()],
                               use_bin_type=True)
        return [header, hmac.digest(self._secret, header, hashlib.sha256), body]

    # ------------------------------------------------------------ receiving
    def open(self, frames: list[Buffer]) -> Envelope:
        """Verify and unpack; raises Reject. Does not apply replay protection."""
        env, body, digest = self._verified_header(frames)
        self._check_body(body, digest)
        return self._unpacked(env, body)

    def _verified_header(self, frames: list[Buffer]) -> tuple[Envelope, Buffer, bytes]:
        """The envelope of an authentic header (its body not yet read), the body and the digest
        the header gives for it. Nothing here reads the body: a 60 MB frame costs what an empty
        one does."""
        if len(frames) != 3:
            raise Reject("malformed", f"expected 3 frames, got {len(frames)}", reply=False)
        header, mac, body = frames
        if len(header) > MAX_HEADER_BYTES:
            raise Reject("malformed", f"a {len(header)}-byte header (at most {MAX_HEADER_BYTES})", reply=False)
        if len(body) > self.max_bytes:
            raise Reject("oversized", f"{len(body)} bytes > limit {self.max_bytes}", reply=False)
        if not hmac.compare_digest(hmac.digest(self._secret, header, hashlib.sha256), mac):
            raise Reject("unauthorized", "bad or missing signature", reply=False)
        try:
            kind, client_id, seq, ts, size, digest = msgpack.unpackb(header, raw=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise Reject("malformed", f"not a msgpack header: {e}") from None
        if not (isinstance(kind, str) and isinstance(client_id, bytes) and type(seq) is int
                and isinstance(ts, (int, float)) and type(size) is int and isinstance(digest, bytes)):
            raise Reject("malformed", "bad envelope header")
        if not math.isfinite(ts):  # NaN compares false with everything: it would never expire
            raise Reject("malformed", f"timestamp {ts} is not a finite number", client_id=client_id, seq=seq)
        if size != len(body):
            raise Reject("unauthorized", f"the body has {len(body)} bytes, its signed header says {size}", reply=False)
        return Envelope(kind, client_id, seq, float(ts), None), body, digest

    @staticmethod
    def _check_body(body: Buffer, digest: bytes) -> None:
        """The body is the one the signed header names."""
        if not hmac.compare_digest(hashlib.sha256(body).digest(), digest):
            raise Reject("unauthorized", "the body does not match its signed header", reply=False)

    @staticmethod
    def _unpacked(env: Envelope, body: Buffer) -> Envelope:
        try:
            env.body = msgpack.unpackb(body, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise Reject("malformed", f"not a msgpack body: {e}", client_id=env.client_id, seq=env.seq) from None
        return env

    def check_fresh(self, env: Envelope, record: bool = True) -> None:
        """Replay protection for requests (see module docstring); `record`: remember its seq."""
        now = time.time()
        if env.ts < self.not_before:
            raise Reject("signed_before_start", f"signed {self.not_before - env.ts:.1f}s before this receiver started "
                                                f"(a replay, or a request queued across a restart)", reply=False)
        if abs(now - env.ts) > self.max_skew_s:
            raise Reject("replayed", f"timestamp {now - env.ts:+.0f}s off (limit {self.max_skew_s:.0f}s)",
                         client_id=env.client_id, seq=env.seq)
        last = self._last_seq.get(env.client_id)
        if last is not None and env.seq <= last[0]:
            raise Reject("replayed", f"sequence {env.seq} already seen", client_id=env.client_id, seq=env.seq)
        if not record:
            return
        self._last_seq[env.client_id] = (env.seq, now)
        if now > self._next_prune:
            horizon = now - 2 * self.max_skew_s
            self._last_seq = {c: v for c, v in self._last_seq.items() if v[1] > horizon}
            self._next_prune = now + self.max_skew_s

    def request(self, frames: list[Buffer]) -> tuple[Envelope, Any]:
        """A verified, fresh, decoded request. A replayed header is refused before its body is
        hashed, and its seq is remembered only once the body has verified: a forged body under
        a captured header must not use up the genuine message's seq."""
        env, body, digest = self._verified_header(frames)
        self.check_fresh(env, record=False)
        self._check_body(body, digest)
        self.check_fresh(env)
        return env, self._typed(messages.REQUESTS, self._unpacked(env, body))

    def reply(self, frames: list[bytes]) -> tuple[Envelope, Any]:
        env = self.open(frames)
        return env, self._typed(messages.REPLIES, env)

    def try_reply(self, frames: list[bytes]) -> tuple[Envelope, Any] | None:
        """`reply`, or None for a reply that fails verification or decoding: it is dropped
        like an unknown one, counted in `dropped` and logged (the first of each reason)."""
        try:
            return self.reply(frames)
        except Reject as e:
            code, why = e.code, e.message
        except Exception as e:  # noqa: BLE001 - nothing a peer sends may raise out of a client
            code, why = "malformed", repr(e)
        self.dropped[code] += 1
        if self.dropped[code] == 1:
            log.warning("dropped a reply (%s: %s); further ones are counted, not logged", code, why)
        return None

    @staticmethod
    def _typed(table: dict[str, type], env: Envelope) -> Any:
        cls = table.get(env.kind)
        if cls is None:
            raise Reject("bad_request", f"unknown message kind {env.kind!r}", client_id=env.client_id, seq=env.seq)
        try:
            return decode(cls, env.body)
        except WireError as e:
            raise Reject("bad_request", str(e), client_id=env.client_id, seq=env.seq) from None
