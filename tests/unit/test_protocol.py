"""Signed msgpack envelopes, typed decoding and the rejection of hostile input."""
from __future__ import annotations

import asyncio
import os
import time

import msgpack
import numpy as np
import pytest
import zmq

from astraflow.bench.payload import random_trajectory
from astraflow.protocol import messages as m
from astraflow.protocol.codec import Codec, Reject

SECRET = os.urandom(32)
CID = b"c" * 16


def _batch(n: int = 3, tokens: int = 20) -> m.TrajectoryBatch:
    rng = np.random.default_rng(0)
    return m.TrajectoryBatch.from_trajectories([random_trajectory(rng, "policy", tokens, prompt_tokens=4) for _ in range(n)])


def test_commit_roundtrip_keeps_every_column():
    sent = m.Commit("w0.r0", 5, _batch(), versions={"policy": 2})
    env, got = Codec(SECRET).request(Codec(SECRET).pack(sent, CID, 1))
    assert env.kind == "commit" and env.seq == 1 and got.task_id == 5 and got.versions == {"policy": 2}
    for col in ("lengths", *m.TOKEN_FIELDS, *m.ROW_FIELDS):
        np.testing.assert_array_equal(getattr(got.trajectories, col), getattr(sent.trajectories, col))
    assert got.trajectories.meta == sent.trajectories.meta
    t = got.trajectories.trajectory(1)
    np.testing.assert_array_equal(t.tokens, sent.trajectories.trajectory(1).tokens)


def test_wrong_signature_and_unsigned_are_dropped_without_reply():
    frames = Codec(SECRET).pack(m.Status(), CID, 1)
    with pytest.raises(Reject) as e:
        Codec(os.urandom(32)).request(frames)
    assert e.value.code == "unauthorized" and not e.value.reply
    with pytest.raises(Reject) as e:
        Codec(SECRET).request([frames[0]])
    assert e.value.code == "malformed" and not e.value.reply


def test_replayed_and_stale_messages_are_refused():
    codec = Codec(SECRET, max_skew_s=60)
    frames = codec.pack(m.Status(), CID, 1)
    codec.request(frames)
    with pytest.raises(Reject, match="replayed: sequence 1 already seen"):
        codec.request(frames)
    with pytest.raises(Reject, match="replayed: timestamp"):
        codec.request(_signed("status", {}, ts=time.time() - 3600))


def test_oversized_is_refused_before_verification():
    codec = Codec(SECRET, max_bytes=1000)
    with pytest.raises(Reject) as e:
        codec.request(codec.pack(m.Commit("w", 1, _batch(4, 64)), CID, 1))
    assert e.value.code == "oversized"


def _signed(kind: str, body, seq: int = 1, ts: float | None = None, cid: bytes = CID) -> list[bytes]:
    """Correctly signed frames around any body (raw bytes, or anything msgpack packs)."""
    raw = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    return Codec(SECRET).seal(kind, cid, seq, time.time() if ts is None else ts, raw)


def test_signed_garbage_and_bad_fields_name_the_problem():
    with pytest.raises(Reject, match="malformed"):
        Codec(SECRET).request(_signed("status", b"\xc1\xc1 not msgpack"))
    with pytest.raises(Reject, match=r"bad_request: Lease\.n: expected int, got str"):
        Codec(SECRET).request(_signed("lease", {"worker_id": "w", "n": "many"}))
    with pytest.raises(Reject, match="unknown message kind 'nuke'"):
        Codec(SECRET).request(_signed("nuke", {}, seq=2))


def test_inconsistent_trajectory_columns_are_rejected():
    wire = Codec(SECRET)
    b = _batch()
    body = m.Commit("w", 1, b)
    from astraflow.protocol.wire import encode
    raw = encode(body)
    raw["trajectories"]["logprobs"] = raw["trajectories"]["logprobs"][:-4]  # one float short
    with pytest.raises(Reject, match=r"Commit\.trajectories: logprobs has 59 entries, lengths sum to 60"):
        wire.request(_signed("commit", raw))
    raw = encode(body)
    raw["trajectories"]["tokens"] = raw["trajectories"]["tokens"][:-1]  # not whole int32s
    with pytest.raises(Reject, match="not a whole number of int32"):
        wire.request(_signed("commit", raw, seq=2))


def test_gather_selects_trajectories_in_order():
    a, b = _batch(3, 10), _batch(2, 7)
    g = m.TrajectoryBatch.gather([(b, 1), (a, 0), (a, 2)])
    assert list(g.lengths) == [7, 10, 10]
    np.testing.assert_array_equal(g.trajectory(0).tokens, b.trajectory(1).tokens)
    np.testing.assert_array_equal(g.trajectory(2).logprobs, a.trajectory(2).logprobs)
    assert g.meta == [b.meta[1], a.meta[0], a.meta[2]]


def test_non_finite_timestamps_are_refused():
    """A NaN timestamp passed the freshness check (every comparison with NaN is false) and so
    never expired: its message could be replayed whenever its client had been pruned."""
    for i, ts in enumerate((float("nan"), float("inf"), float("-inf"))):
        with pytest.raises(Reject, match="malformed: timestamp"):
            Codec(SECRET).request(_signed("status", {}, seq=i + 1, ts=ts))


def test_a_message_signed_before_the_rank_started_is_dropped():
    captured = Codec(SECRET).pack(m.Status(), CID, 1)
    with pytest.raises(Reject) as e:
        Codec(SECRET, not_before=time.time() + 1).request(captured)  # a rank started after it was signed
    assert e.value.code == "signed_before_start" and not e.value.reply  # dropped: a retry is signed afresh
    Codec(SECRET, not_before=time.time() - 60).request(captured)


class _Rank:
    """A ROUTER socket standing in for the dataflow rank: it answers as told."""

    def __init__(self) -> None:
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def answer(self, *replies: list[bytes]) -> None:
        identity = self.sock.recv_multipart()[0]
        for frames in replies:
            self.sock.send_multipart([identity, *frames])


def test_both_clients_drop_a_badly_signed_reply_and_count_it():
    """The synchronous client raised on a reply with a bad signature; the async one dropped
    it silently. Both drop it now, count it by reason and take the genuine reply."""
    from astraflow.protocol.aclient import AsyncClient
    from astraflow.protocol.client import Client

    rank = _Rank()
    sync = Client(rank.address, SECRET, timeout_s=5)
    seq = sync.send(m.Status())
    forged = Codec(os.urandom(32)).pack(m.StatusReply({"forged": True}), sync.client_id, seq)
    rank.answer(forged, Codec(SECRET).pack(m.StatusReply({"ok": True}), sync.client_id, seq))
    assert sync.poll(seq, 5).status == {"ok": True} and sync.codec.dropped == {"unauthorized": 1}
    sync.close()

    async def call_async() -> tuple[m.StatusReply, dict]:
        client = AsyncClient(rank.address, SECRET, timeout_s=5)
        pending = asyncio.ensure_future(client.call(m.Status()))
        await asyncio.sleep(0)
        forged = Codec(SECRET).pack(m.StatusReply({"forged": True}), client.client_id, 1)
        forged[1] = b"x" * 32
        await asyncio.get_running_loop().run_in_executor(None, rank.answer, forged,
            Codec(SECRET).pack(m.StatusReply({"ok": True}), client.client_id, 1))
        reply = await pending
        client.close()
        return reply, dict(client.codec.dropped)

    reply, dropped = asyncio.run(call_async())
    assert reply.status == {"ok": True} and dropped == {"unauthorized": 1}
    rank.sock.close(0)


def test_a_wrongly_signed_frame_near_the_size_limit_is_refused_without_reading_it():
    """The signature covered the whole payload: a 60 MB frame with a wrong signature cost a
    full HMAC (50 ms here) before it could be refused, and a peer without the secret stalled a
    correct client for seconds. It now covers a small header that covers the body."""
    codec = Codec(SECRET, max_bytes=64 << 20)
    frames = Codec(os.urandom(32)).pack(m.Heartbeat("w", {"x" * (32 << 20): 1}), CID, 1)  # not the run secret
    t0 = time.perf_counter()
    for _ in range(10):
        with pytest.raises(Reject, match="unauthorized"):
            codec.request(frames)
    assert time.perf_counter() - t0 < 0.03  # a full HMAC of 32 MB ten times: 0.27 s here


def test_a_body_swapped_under_a_signed_header_is_refused_and_spends_nothing():
    """A captured header with another body of the same length: refused, and its seq is not
    used up, so the genuine message still goes through."""
    codec = Codec(SECRET)
    genuine = Codec(SECRET).pack(m.Heartbeat("w"), CID, 7)
    forged = [genuine[0], genuine[1], genuine[2].replace(b"w", b"x")]
    assert len(forged[2]) == len(genuine[2]) and forged[2] != genuine[2]
    with pytest.raises(Reject, match="unauthorized: the body does not match its signed header"):
        codec.request(forged)
    assert codec.request(genuine)[1] == m.Heartbeat("w")
