"""A control-plane client: one ZeroMQ DEALER socket, signed requests, matched replies.

`call()` is the simple blocking form. `send()` + `poll()` let one thread drive many clients
(the dataflow benchmark's lightweight clients). The address is read from
`RUN_DIR/rendezvous/dataflow.json`, and re-read after a timeout, so a client follows a
dataflow rank that restarted on another port or node.

Requests are not retried here: the caller decides, because only it knows which requests are
idempotent (commit by task id, batch by step, ...). A reply to an abandoned request (one
whose `call` timed out) is recognised by its seq and dropped; a caller that `send`s without
collecting the reply must `abandon` it, or its reply is kept until it does. A reply that
fails verification is dropped too (counted in `codec.dropped`), never raised.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import zmq

from astraflow.protocol import messages
from astraflow.protocol.codec import Codec, RemoteError

RENDEZVOUS_FILE = "dataflow.json"


def read_rendezvous(run_dir: str | Path) -> dict:
    path = Path(run_dir) / "rendezvous" / RENDEZVOUS_FILE
    return json.loads(path.read_text())


def moved_to(run_dir: str | Path, address: str) -> str | None:
    """The rank's new address if it published one other than `address` (it restarted)."""
    try:
        current = read_rendezvous(run_dir)["address"]
    except (OSError, ValueError, KeyError):
        return None  # being rewritten: look again next time
    return current if current != address else None


def wait_rendezvous(run_dir: str | Path, timeout_s: float = 60.0, newer_than: float = 0.0) -> dict:
    """Wait for a dataflow rank to publish its address (started after `newer_than`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = read_rendezvous(run_dir)
            if info.get("started", 0.0) > newer_than:
                return info
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no dataflow rank published an address in {run_dir}/rendezvous within {timeout_s:.0f}s")
        time.sleep(0.05)


class Client:
    def __init__(self, address: str, secret: bytes, timeout_s: float = 30.0,
                 context: zmq.Context | None = None, max_bytes: int = 1 << 30) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.codec = Codec(secret, max_bytes=max_bytes)
        self.client_id = os.urandom(16)
        self._seq = 0
        self._outstanding: set[int] = set()
        self._replies: dict[int, Any] = {}
        self._ctx = context or zmq.Context.instance()
        self.sock = self._connect()

    @classmethod
    def from_run_dir(cls, run_dir: str | Path, secret: bytes, timeout_s: float = 30.0, **kw: Any) -> "Client":
        return cls(wait_rendezvous(run_dir, timeout_s)["address"], secret, timeout_s, **kw)

    def _connect(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.address)
        return sock

    def reconnect(self, address: str | None = None) -> None:
        self.sock.close(0)
        self._outstanding.clear()
        self._replies.clear()
        if address:
            self.address = address
        self.sock = self._connect()

    def send(self, request: Any) -> int:
        self._seq += 1
        self.sock.send_multipart(self.codec.pack(request, self.client_id, self._seq), copy=False)
        self._outstanding.add(self._seq)
        return self._seq

    def poll(self, seq: int, timeout_s: float) -> Any | None:
        """The reply to request `seq`, or None on timeout. Raises RemoteError on an Error reply.

        Replies to other outstanding requests that arrive meanwhile are kept for their own
        `poll` (several requests may be in flight on one client).
        """
        deadline = time.monotonic() + timeout_s
        while seq not in self._replies:
            left = max(0.0, deadline - time.monotonic())
            if not self.sock.poll(int(left * 1000)):
                return None
            got = self.codec.try_reply(self.sock.recv_multipart())
            if got is None:
                continue  # badly signed or malformed: dropped and counted in codec.dropped
            env, reply = got
            if env.client_id == self.client_id and env.seq in self._outstanding:
                self._outstanding.discard(env.seq)
                self._replies[env.seq] = reply
        reply = self._replies.pop(seq)
        if isinstance(reply, messages.Error):
            raise RemoteError(reply.code, reply.message)
        return reply

    def abandon(self, seq: int) -> None:
        """Forget a request whose reply is no longer wanted (a late reply is then dropped)."""
        self._outstanding.discard(seq)
        self._replies.pop(seq, None)

    def call(self, request: Any, timeout_s: float | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        seq = self.send(request)
        reply = self.poll(seq, timeout)
        if reply is None:
            self.abandon(seq)
            raise TimeoutError(f"{type(request).__name__} to {self.address}: no reply within {timeout:.1f}s")
        return reply

    def close(self) -> None:
        self.sock.close(0)
