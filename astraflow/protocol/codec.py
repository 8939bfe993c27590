"""Signed msgpack envelopes (never pickle) and replay protection.

On the wire a message is two ZeroMQ frames: `payload`, `mac`.
    payload = msgpack([kind, client_id, seq, ts, body])
    mac     = HMAC-SHA256(run secret, payload)
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
        payload = msgpack.packb([kind, client_id, seq, time.time(), encode(msg)], use_bin_type=True)
        return [payload, self.sign(payload)]

    def sign(self, payload: bytes) -> bytes:
        return hmac.digest(self._secret, payload, hashlib.sha256)

    # ------------------------------------------------------------ receiving
    def open(self, frames: list[bytes]) -> Envelope:
        """Verify and unpack; raises Reject. Does not apply replay protection."""
        if len(frames) != 2:
            raise Reject("malformed", f"expected 2 frames, got {len(frames)}", reply=False)
        payload, mac = frames
        if len(payload) > self.max_bytes:
            raise Reject("oversized", f"{len(payload)} bytes > limit {self.max_bytes}", reply=False)
        if not hmac.compare_digest(hmac.digest(self._secret, payload, hashlib.sha256), mac):
            raise Reject("unauthorized", "bad or missing signature", reply=False)
        try:
            kind, client_id, seq, ts, body = msgpack.unpackb(payload, raw=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise Reject("malformed", f"not a msgpack envelope: {e}") from None
        if not (isinstance(kind, str) and isinstance(client_id, bytes) and type(seq) is int
                and isinstance(ts, (int, float))):
            raise Reject("malformed", "bad envelope header")
        if not math.isfinite(ts):  # NaN compares false with everything: it would never expire
            raise Reject("malformed", f"timestamp {ts} is not a finite number", client_id=client_id, seq=seq)
        return Envelope(kind, client_id, seq, float(ts), body)

    def check_fresh(self, env: Envelope) -> None:
        """Replay protection for requests (see module docstring)."""
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
        self._last_seq[env.client_id] = (env.seq, now)
        if now > self._next_prune:
            horizon = now - 2 * self.max_skew_s
            self._last_seq = {c: v for c, v in self._last_seq.items() if v[1] > horizon}
            self._next_prune = now + self.max_skew_s

    def request(self, frames: list[bytes]) -> tuple[Envelope, Any]:
        env = self.open(frames)
        self.check_fresh(env)
        return env, self._typed(messages.REQUESTS, env)

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
