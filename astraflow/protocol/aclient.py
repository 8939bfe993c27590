"""The asyncio control-plane client used by rollout workers (many requests in flight).

Same wire format and rules as `client.Client`; a reader task matches replies to requests by
seq. `call` raises TimeoutError after `timeout_s`; the caller decides whether to retry and
may `reconnect` to a new address (a restarted dataflow rank).
"""
from __future__ import annotations

import asyncio
import os
from typing import Any

import zmq
import zmq.asyncio

from astraflow.protocol import messages
from astraflow.protocol.codec import Codec, RemoteError


class AsyncClient:
    def __init__(self, address: str, secret: bytes, timeout_s: float = 30.0) -> None:
        self.codec = Codec(secret, max_bytes=1 << 30)
        self.timeout_s = timeout_s
        self.client_id = os.urandom(16)
        self._ctx = zmq.asyncio.Context.instance()
        self._seq = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self.address = address
        self.sock = self._connect(address)

    def _connect(self, address: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    def reconnect(self, address: str) -> None:
        if self._reader:
            self._reader.cancel()
            self._reader = None
        self.sock.close(0)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(TimeoutError("reconnected"))
        self._pending.clear()
        self.address = address
        self.sock = self._connect(address)

    async def _read(self) -> None:
        while True:
            got = self.codec.try_reply(await self.sock.recv_multipart())
            if got is None:
                continue  # badly signed or malformed: dropped and counted in codec.dropped
            env, reply = got
            fut = self._pending.pop(env.seq, None) if env.client_id == self.client_id else None
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def call(self, request: Any, timeout_s: float | None = None) -> Any:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        self._seq += 1
        seq = self._seq
        fut = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        await self.sock.send_multipart(self.codec.pack(request, self.client_id, seq))
        try:
            reply = await asyncio.wait_for(fut, self.timeout_s if timeout_s is None else timeout_s)
        except asyncio.TimeoutError:
            self._pending.pop(seq, None)
            raise TimeoutError(f"{type(request).__name__} to {self.address}: no reply") from None
        if isinstance(reply, messages.Error):
            raise RemoteError(reply.code, reply.message)
        return reply

    def close(self) -> None:
        if self._reader:
            self._reader.cancel()
        self.sock.close(0)
