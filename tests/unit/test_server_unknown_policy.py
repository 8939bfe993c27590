"""A signed request naming a policy the run does not have is refused with an error; the rank
serves on.

Found by the fuzz chaos test (seed 407805807): a signed `Batch` for a policy named by random
characters got its `unknown policy` error from the state, and then the server stopped the
trainer-wait clock of that policy — a KeyError that took the whole rank down."""
from __future__ import annotations

import os

from astraflow.config.rundir import RunDir
from astraflow.dataflow.server import DataflowServer
from astraflow.protocol import messages as m
from astraflow.protocol.codec import Codec

CONFIG = """
run: {name: unknown-policy, seed: 0}
dataflow: {interface: loopback}
tasks: {kind: arithmetic, group_size: 4, heldout: 0}
policies: [{name: policy}]
"""
STRANGER = "ᑚȺ▲Ć⌋◶"
REQUESTS = [
    m.Batch(STRANGER, 1, 16),
    m.Weights(STRANGER),
    m.Ready(m.PROTOCOL_VERSION, STRANGER, 0),
    m.Consumed(STRANGER, 1, [0]),
    m.Published(STRANGER, 1, "file:///nowhere", []),
    m.Stopped(STRANGER, 1),
    m.Register(m.PROTOCOL_VERSION, "w", [STRANGER], 4),
]


def test_requests_for_an_unknown_policy_get_errors_and_the_rank_serves_on(tmp_path):
    (tmp_path / "run.yaml").write_text(CONFIG)
    run = RunDir.create(tmp_path / "run", tmp_path / "run.yaml")
    server = DataflowServer(run, local=True)
    client = Codec(run.read_secret())
    client_id = os.urandom(16)
    try:
        for seq, request in enumerate([*REQUESTS, m.Status()], start=1):
            server._on_message([b"peer", *client.pack(request, client_id, seq)])
        replies = [client.reply(frames[1:])[1] for frames in server.outbox]
    finally:
        server.state.close()
        server.sock.close(0)
        server.ctx.term()
    assert [type(r).__name__ for r in replies[:-1]] == ["Error"] * len(REQUESTS)
    assert all(STRANGER in r.message for r in replies[:-1]), [r.message for r in replies]
    assert isinstance(replies[-1], m.StatusReply) and replies[-1].status["protocol"]["counters"]["batch"] == 1
