"""The dataflow rank's event loop: one ZeroMQ ROUTER socket, one thread.

Each turn of the loop:
  1. drains up to `MAX_DRAIN` waiting messages (verify, decode, handle; bad ones are counted
     and answered with an Error or dropped — nothing a peer sends can raise out of here);
  2. expires leases, declares silent workers dead, retries parked batch requests;
  3. flushes the store and the journal once for everything handled (group commit);
  4. only then sends the replies.
So an acknowledgement always follows the flush that made its data durable, and one HDF5
flush serves every commit that arrived in the same turn.

Oversized input: the socket drops anything over twice the configured limit before it is
buffered (ZMQ_MAXMSGSIZE); between the limit and that, the codec counts and drops it.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
import traceback
from pathlib import Path
from typing import Any

import zmq

from astraflow.config.rundir import RunDir
from astraflow.dataflow import address
from astraflow.dataflow.compact import Compaction
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from astraflow.protocol.client import RENDEZVOUS_FILE
from astraflow.protocol.codec import Codec, Reject
from astraflow.store.errors import StoreStop

log = logging.getLogger(__name__)

MAX_DRAIN = 512
IDLE_POLL_S = 0.05
# Requests signed more than this before the rank started are dropped (replay protection across
# restarts): a retry is signed afresh, and a restart takes longer than this anyway.
RESTART_SLACK_S = 1.0


class DataflowServer:
    def __init__(self, run: RunDir, local: bool | None = None) -> None:
        self.run = run
        cfg = run.config.dataflow
        self.max_bytes = int(cfg.max_message_mb * (1 << 20))
        self.codec = Codec(run.read_secret(), max_bytes=self.max_bytes, max_skew_s=cfg.max_clock_skew_s,
                           not_before=time.time() - RESTART_SLACK_S)
        self.state = DataflowState(run.path, run.config)
        self.state.recover()
        self.compaction = Compaction(run.path, cfg.compact_every_s, self.state.clock)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 2 * self.max_bytes)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        host = address.resolve(cfg.interface, local)
        if cfg.port:
            self.sock.bind(f"tcp://{host}:{cfg.port}")
        else:
            self.sock.bind_to_random_port(f"tcp://{host}")
        self.address = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        # batch requests waiting for samples, one per (policy, step, rank, member): a newer one
        # replaces the older; the state machine bounds steps, ranks and members, so a policy has
        # at most trainer.world x STEPS_AHEAD of them, however many a peer sends
        self.parked: dict[tuple[str, int, int, int], tuple[bytes, bytes, int, m.Batch]] = {}
        self.outbox: list[list[bytes]] = []
        self.running = True

    def publish_rendezvous(self) -> None:
        info = {"address": self.address, "host": socket.gethostname(), "pid": os.getpid(),
                "started": time.time(), "incarnation": self.state.incarnation,
                "protocol_version": m.PROTOCOL_VERSION}
        path = self.run.path / "rendezvous" / RENDEZVOUS_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)
        log.info("dataflow rank listening on %s (incarnation %d)", self.address, self.state.incarnation)

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        self.publish_rendezvous()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        # Slurm's warning before preemption reaches every process of the step: the rank keeps
        # serving, so that trainers and workers can checkpoint and hand back their leases;
        # its supervisor stops it (SIGTERM) once they are gone
        signal.signal(signal.SIGUSR1, self._warned)
        try:
            while self.running:
                self.turn()
        finally:
            self.compaction.close()
            self.state.close()
            self.sock.close(0)
            self.ctx.term()

    def _warned(self, signum: int, frame: Any) -> None:
        log.info("signal %d (preemption warning): serving on until stopped", signum)

    def _stop(self, signum: int, frame: Any) -> None:
        log.info("signal %d: stopping after this turn", signum)
        self.running = False

    def turn(self) -> None:
        now = self.state.clock()
        deadline = self.state.next_deadline()
        timeout = IDLE_POLL_S if deadline is None else min(IDLE_POLL_S, max(0.0, deadline - now))
        if self.sock.poll(int(timeout * 1000)):
            for _ in range(MAX_DRAIN):
                try:
                    # not copied: a body (up to max_message_mb) is read in place, and one with a
                    # wrong signature is never read at all (protocol/codec.py)
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._on_message([frames[0].bytes, *(f.buffer for f in frames[1:])])
        now = self.state.clock()
        self.state.tick(now)
        self._retry_parked(now)
        self.state.flush()
        for frames in self.outbox:
            try:
                self.sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError:
                self.state.counters["reply_dropped"] += 1
        self.outbox.clear()
        self.compaction.poll()

    def _on_message(self, frames: list[bytes | memoryview]) -> None:
        identity, body = frames[0], frames[1:]
        try:
            env, request = self.codec.request(body)
        except Reject as e:
            key = f"rejected_{e.code}"
            self.state.counters[key] += 1
            n = self.state.counters[key]
            if e.code == "signed_before_start" and n & (n - 1) == 0:  # the 1st, 2nd, 4th, ...: a clock behind?
                log.warning("dropped %d messages signed before this rank started: replays, requests queued across "
                            "the restart, or a client whose clock is behind this node's (%s)", n, e.message)
            if e.reply and e.client_id:
                self._reply(identity, e.client_id, e.seq, m.Error(e.code, e.message))
            return
        except Exception as e:  # noqa: BLE001 - nothing a peer sends may take the rank down
            self.state.counters["rejected_malformed"] += 1
            log.debug("undecodable message: %r", e)
            return
        self._dispatch(identity, env.client_id, env.seq, request)

    def _handle(self, request: Any, now: float, count: bool = True) -> Any:
        try:
            return self.state.handle(request, now, count)
        except StoreStop:
            raise  # the store cannot go on safely: the rank stops, saying why (store/errors.py)
        except Exception:  # noqa: BLE001 - a bug in one handler must not stop the rank
            self.state.counters["error_internal"] += 1
            log.error("internal error on %s:\n%s", type(request).__name__, traceback.format_exc())
            return m.Error("internal", "the dataflow rank failed on this request; see its log")

    def _dispatch(self, identity: bytes, client_id: bytes, seq: int, request: Any) -> None:
        reply = self._handle(request, self.state.clock())
        if reply is None:
            key = (request.policy, request.step, request.rank, request.member)
            self.parked[key] = (identity, client_id, seq, request)
            self.state.waits[request.policy].start(self.state.clock())
            return
        if isinstance(request, m.Batch) and not isinstance(reply, m.Error):  # an Error may name no policy of ours
            self.state.waits[request.policy].stop(self.state.clock())
        self._reply(identity, client_id, seq, reply)

    def _retry_parked(self, now: float) -> None:
        for key, (identity, client_id, seq, request) in list(self.parked.items()):
            reply = self._handle(request, now, count=False)
            if reply is None:
                continue
            del self.parked[key]
            if not any(k[0] == request.policy for k in self.parked):
                self.state.waits[request.policy].stop(now)
            self._reply(identity, client_id, seq, reply)

    def _reply(self, identity: bytes, client_id: bytes, seq: int, reply: Any) -> None:
        self.outbox.append([identity, *self.codec.pack(reply, client_id, seq)])


def run_dataflow(run_dir: Path, local: bool | None = None) -> None:
    DataflowServer(RunDir.open(run_dir), local).serve()
