"""The asyncio control-plane client used by rollout workers (many requests in flight).

Same wire format and rules as `client.Client`; a reader task matches replies to requests by
seq. `call` raises TimeoutError after `timeout_s`; the caller decides whether to retry and
may `reconnect` to a new address (a restarted dataflow rank).

`link_down` is set when the connection to the rank drops (ZeroMQ's socket monitor: the
rank's process exited or closed its socket, so the kernel ended the TCP connection) and
cleared when it is up again. A worker waits on it to look for a restarted rank, instead of
reading the rendezvous file on a timer: 1,000 workers polling a file every 0.5 s are 2,000
metadata operations a second on a parallel filesystem, for nothing while the rank is
healthy. A rank whose node vanished without closing its connections shows as timeouts.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
from typing import Any, Callable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from astraflow.protocol import messages
from astraflow.protocol.codec import Codec, RemoteError

log = logging.getLogger(__name__)


class AsyncClient:
    def __init__(self, address: str, secret: bytes, timeout_s: float = 30.0) -> None:
        self.codec = Codec(secret, max_bytes=1 << 30)
        self.timeout_s = timeout_s
        self.client_id = os.urandom(16)
        self._ctx = zmq.asyncio.Context.instance()
        self._seq = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        self._monitor: asyncio.Task | None = None
        self.link_down = asyncio.Event()
        self.address = address
        self.sock = self._connect(address)

    def _connect(self, address: str) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock

    async def _watch(self, events: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await events.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self.link_down.set()
            else:
                self.link_down.clear()

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        if self._reader is None:
            self._reader = loop.create_task(self._read())
        if self._monitor is None:
            events = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            self._monitor = loop.create_task(self._watch(events))
            self._monitor.add_done_callback(lambda _: events.close(0))

    def _stop(self) -> None:
        if self._monitor:
            self.sock.disable_monitor()
        for task in (self._reader, self._monitor):
            if task:
                task.cancel()
        self._reader = self._monitor = None

    def reconnect(self, address: str) -> None:
        self._stop()
        self.link_down.clear()  # a new connection: down again only once it has been up
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
        self._start()
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
        self._stop()
        self.sock.close(0)


async def follow(client: AsyncClient, moved: Callable[[], str | None], first_s: float = 0.2,
                 max_s: float = 2.0) -> None:
    """Forever: once `client.link_down` is set, ask `moved()` for the rank's new address
    (reading the rendezvous file) with jittered backoff from `first_s` to `max_s`, and
    reconnect there; stop asking when the link is up again (the rank came back at the same
    address and ZeroMQ reconnected by itself). Nothing is read while the link is up."""
    while True:
        await client.link_down.wait()
        delay = first_s
        while client.link_down.is_set():
            address = moved()
            if address is not None:
                log.info("dataflow rank moved to %s: reconnecting", address)
                client.reconnect(address)
                break
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))  # 1,000 workers do not read in step
            delay = min(2 * delay, max_s)
