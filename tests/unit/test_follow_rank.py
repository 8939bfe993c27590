"""A worker's client re-finds a restarted dataflow rank without polling the rendezvous file.

Real ZeroMQ sockets: a ROUTER stands in for the rank (answering `Status` with the run's
codec). While the rank is up, `follow` never asks where it is; when its socket closes, the
client's `link_down` is set within a second and `follow` asks until the rank's new address
appears, then reconnects, and calls are answered there. Before, every worker read the
rendezvous file every 0.5 s for the whole run."""
from __future__ import annotations

import asyncio
import os

import zmq
import zmq.asyncio

from astraflow.protocol import messages as m
from astraflow.protocol.aclient import AsyncClient, follow
from astraflow.protocol.codec import Codec

SECRET = os.urandom(32)


class Rank:
    """A ROUTER that answers every `Status` with its name."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.codec = Codec(SECRET)
        self.name = name
        self.task = asyncio.get_running_loop().create_task(self.serve())

    async def serve(self) -> None:
        while True:
            identity, *frames = await self.sock.recv_multipart()
            env, _ = self.codec.request(frames)
            await self.sock.send_multipart([identity, *self.codec.pack(m.StatusReply({"rank": self.name}),
                                                                       env.client_id, env.seq)])

    def close(self) -> None:
        self.task.cancel()
        self.sock.close(0)


async def scenario() -> None:
    ctx = zmq.asyncio.Context.instance()
    first = Rank(ctx, "first")
    client = AsyncClient(first.address, SECRET, timeout_s=5)
    asked: list[str | None] = []
    published = {"address": first.address}

    def moved() -> str | None:
        new = published["address"]
        asked.append(new)
        return new if new != client.address else None

    follower = asyncio.get_running_loop().create_task(follow(client, moved, first_s=0.05, max_s=0.2))
    for _ in range(20):  # a healthy rank: ten seconds of a worker's life, compressed
        assert (await client.call(m.Status())).status["rank"] == "first"
        await asyncio.sleep(0.05)
    assert asked == [] and not client.link_down.is_set()

    first.close()  # the rank's process is gone: the kernel ends the connection
    await asyncio.wait_for(client.link_down.wait(), 1.0)
    await asyncio.sleep(0.3)
    assert asked and set(asked) == {first.address}  # asked, nothing new yet

    second = Rank(ctx, "second")
    published["address"] = second.address  # the restarted rank publishes its address
    for _ in range(50):
        if client.address == second.address:
            break
        await asyncio.sleep(0.05)
    assert client.address == second.address
    assert (await client.call(m.Status())).status["rank"] == "second"
    n = len(asked)
    await asyncio.sleep(0.5)
    assert len(asked) == n and not client.link_down.is_set()  # up again: no more asking
    follower.cancel()
    client.close()
    second.close()


def test_a_worker_refinds_a_restarted_rank_without_polling_while_it_is_up():
    asyncio.run(scenario())
