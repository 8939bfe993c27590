"""A control-plane client: one ZeroMQ DEALER socket, signed requests, matched replies.

`call()` is the simple blocking form. `send()` + `poll()` let one thread drive many clients
(the dataflow benchmark's lightweight clients). The address is read from
`RUN_DIR/rendezvous/dataflow.json`, and re-read after a timeout, so a client follows a
dataflow rank that restarted on another port or node.

Requests are not retried here: the caller decides, because only it knows which requests are
idempotent (commit by task id, batch by step, ...). A reply to an abandoned request is
recognised by its seq and dropped.
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
        if address:
            self.address = address
        self.sock = self._connect()

    def send(self, request: Any) -> int:
        self._seq += 1
        self.sock.send_multipart(self.codec.pack(request, self.client_id, self._seq), copy=False)
        return self._seq

    def poll(self, seq: int, timeout_s: float) -> Any | None:
        """The reply to request `seq`, or None on timeout. Raises RemoteError on an Error reply."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000) + 1):
                return None
            frames = self.sock.recv_multipart()
            env, reply = self.codec.reply(frames)
            if env.seq != seq or env.client_id != self.client_id:
                continue  # answer to an abandoned request
            if isinstance(reply, messages.Error):
                raise RemoteError(reply.code, reply.message)
            return reply

    def call(self, request: Any, timeout_s: float | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        seq = self.send(request)
        reply = self.poll(seq, timeout)
        if reply is None:
            raise TimeoutError(f"{type(request).__name__} to {self.address}: no reply within {timeout:.1f}s")
        return reply

    def close(self) -> None:
        self.sock.close(0)
