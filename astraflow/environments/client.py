"""The rollout worker's side of the environment protocol (docs/environments.md, `server.py`).

A slow, dead or broken environment server costs episodes, never the worker: every failure
to reach it, a timeout, an error status or a reply that is not the protocol's raises
`EpisodeError` with a `kind` (`KINDS`) and a one-line reason naming the call, and the
worker hands the task back and records the failure (`rollout/worker.py`). Limits, from
`workflow.env_*` (`EnvLimits`):
- connection pooling: one `aiohttp` session per client, keep-alive connections, at most
  `connections` open to the server (further requests wait for a free one);
- a per-request timeout (`request_timeout_s`, connecting and the whole reply);
- retries for idempotent calls only: `/cancel` (cancelling twice ends the same episode, and
  an unknown episode is fine) and `GET /health`, after a timeout, a dropped connection or a
  5xx status. `/start` and `/step` change the server's state, so they are retried only when
  the connection could not be made at all (nothing was sent). Up to `retries` retries per
  call, with exponential backoff, drawn from a budget shared by the client: each request
  adds `retry_budget` of a retry (at most `BUDGET_CAP` banked), so retries stay a bounded
  fraction of the load while a server is down instead of multiplying it;
- a per-episode deadline (`episode_deadline_s`, 0 = none): from `/start`, every call of the
  episode must finish by then; a call's timeout is cut to what is left, and one that would
  start past it fails at once (`deadline`) and the episode is cancelled on the server.

`builtin()` starts the built-in server as a child process on loopback with a fresh bearer
token and connects to it.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import secrets
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp

from astraflow.config.schema import WorkflowConfig
from astraflow.protocol.messages import Task
from astraflow.workflows.api import EpisodeError

IDEMPOTENT = frozenset({"/cancel", "/health"})
KINDS = ("unreachable", "timeout", "http_error", "bad_reply", "deadline")
BUDGET_CAP = 10.0  # retries banked at most (and at the start)
BACKOFF_S = 0.05  # the first retry's delay; doubled per retry, with jitter


@dataclass(frozen=True)
class EnvLimits:
    request_timeout_s: float = 30.0
    retries: int = 2
    retry_budget: float = 0.1
    episode_deadline_s: float = 0.0
    connections: int = 64

    @classmethod
    def of(cls, w: WorkflowConfig) -> "EnvLimits":
        return cls(w.env_request_timeout_s, w.env_retries, w.env_retry_budget, w.env_episode_deadline_s,
                   w.env_connections)


class RetryBudget:
    """Retries earned by requests: each request adds `ratio`, each retry spends 1."""

    def __init__(self, ratio: float, cap: float = BUDGET_CAP) -> None:
        self.ratio, self.cap, self.tokens = ratio, cap, cap

    def request(self) -> None:
        self.tokens = min(self.cap, self.tokens + self.ratio)

    def spend(self) -> bool:
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class EnvironmentClient:
    def __init__(self, url: str, token: str = "", process: asyncio.subprocess.Process | None = None,
                 limits: EnvLimits = EnvLimits()) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.process = process
        self.limits = limits
        self.budget = RetryBudget(limits.retry_budget)
        self.deadlines: dict[str, float] = {}  # episode -> monotonic deadline
        self.retried = 0  # retries made (for tests and the worker's log)
        self.session: aiohttp.ClientSession | None = None

    @classmethod
    async def builtin(cls, wcfg: WorkflowConfig, seed: int) -> "EnvironmentClient":
        token = secrets.token_hex(16)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "astraflow.cli.main", "env-server", "--max-turns", str(wcfg.max_turns),
            "--latency-median-s", str(wcfg.env_latency_median_s), "--latency-p99-s", str(wcfg.env_latency_p99_s),
            "--seed", str(seed), stdout=asyncio.subprocess.PIPE, env={**os.environ, "ASTRAFLOW_ENV_TOKEN": token})
        line = await asyncio.wait_for(proc.stdout.readline(), 60)
        if not line.startswith(b"http://"):
            raise RuntimeError(f"the built-in environment server did not start (said {line!r})")
        return cls(line.decode().strip(), token, proc, EnvLimits.of(wcfg))

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            connector = aiohttp.TCPConnector(limit=self.limits.connections, keepalive_timeout=60)
            self.session = aiohttp.ClientSession(connector=connector, headers=self.headers)
        return self.session

    def _timeout(self, episode: str | None, path: str) -> float:
        """The request's timeout: the limit, cut to what is left of the episode's deadline."""
        deadline = self.deadlines.get(episode) if episode else None
        if deadline is None:
            return self.limits.request_timeout_s
        left = deadline - time.monotonic()
        if left <= 0:
            raise EpisodeError(f"environment {path}: the episode's deadline "
                               f"(workflow.env_episode_deadline_s={self.limits.episode_deadline_s:g}) passed",
                               kind="deadline")
        return min(self.limits.request_timeout_s, left)

    async def call(self, path: str, body: dict | None = None, episode: str | None = None) -> dict:
        """POST `body` to `path` (GET when None); the reply's JSON object, or EpisodeError."""
        attempt = 0
        while True:
            self.budget.request()
            try:
                return await self._once(path, body, self._timeout(episode, path))
            except _Failure as f:
                retry = f.retryable and (path in IDEMPOTENT or not f.sent)
                if not (retry and attempt < self.limits.retries and self.budget.spend()):
                    raise EpisodeError(f"environment {path}: {f.why}", kind=f.kind) from None
            attempt += 1
            self.retried += 1
            await asyncio.sleep(BACKOFF_S * 2 ** attempt * (0.5 + random.random()))

    async def _once(self, path: str, body: dict | None, timeout_s: float) -> dict:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        method = self._session().get if body is None else self._session().post
        kwargs: dict[str, Any] = {} if body is None else {"json": body}
        try:
            async with method(f"{self.url}{path}", timeout=timeout, **kwargs) as reply:
                raw = await reply.read()
                status = reply.status
        except aiohttp.ClientConnectorError as e:
            raise _Failure("unreachable", f"cannot connect to {self.url} ({e.os_error or e})", True, sent=False) from None
        except (asyncio.TimeoutError, TimeoutError):
            raise _Failure("timeout", f"no reply within {timeout_s:.3g} s", True) from None
        except aiohttp.ClientError as e:
            raise _Failure("unreachable", f"connection failed mid-request ({type(e).__name__}: {e})", True) from None
        try:
            data = _json_object(raw)
        except ValueError as e:
            if status != 200:
                raise _Failure("http_error", f"HTTP {status}: {raw[:120]!r}", status >= 500) from None
            raise _Failure("bad_reply", f"reply is not a JSON object ({e}): {raw[:120]!r}", False) from None
        if status != 200:
            raise _Failure("http_error", f"HTTP {status}: {data.get('error', data)}", status >= 500)
        return data

    async def start(self, task: Task) -> tuple[str, str]:
        reply = await self.call("/start", {"prompt": task.prompt, "answer": task.answer})
        episode, observation = _field(reply, "/start", "episode"), _field(reply, "/start", "observation")
        if self.limits.episode_deadline_s > 0:
            self.deadlines[episode] = time.monotonic() + self.limits.episode_deadline_s
        return episode, observation

    async def step(self, episode: str, action: str) -> tuple[str, float, bool]:
        reply = await self.call("/step", {"episode": episode, "action": action}, episode)
        observation, reward, done = (_field(reply, "/step", name) for name in ("observation", "reward", "done"))
        if done:
            self.deadlines.pop(episode, None)
        return observation, float(reward), done

    async def cancel(self, episode: str) -> None:
        """End an episode on the server; best effort (a server that is gone has nothing to end)."""
        self.deadlines.pop(episode, None)
        try:
            await self.call("/cancel", {"episode": episode})
        except EpisodeError:
            pass

    async def health(self) -> dict:
        return await self.call("/health")

    async def check(self, task: Task, answer: str) -> None:
        """One round-trip that submits an answer (solver_verifier's `env_check`)."""
        episode, _ = await self.start(task)
        try:
            _, _, done = await self.step(episode, answer)
        except EpisodeError:
            await self.cancel(episode)
            raise
        if not done:
            await self.cancel(episode)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()


class _Failure(Exception):
    """One request's failure: its kind, why, whether a retry may help, and whether the
    request may have reached the server (`sent`: only a failed connect is known not to)."""

    def __init__(self, kind: str, why: str, retryable: bool, sent: bool = True) -> None:
        super().__init__(why)
        self.kind, self.why, self.retryable, self.sent = kind, why, retryable, sent


def _json_object(raw: bytes) -> dict:
    data = json.loads(raw)
    if not isinstance(data, dict):
        raise ValueError(f"a JSON {type(data).__name__}")
    return data


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


REPLY_FIELDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "episode": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "observation": (lambda v: isinstance(v, str), "a string"),
    "reward": (_is_number, "a number"),
    "done": (lambda v: isinstance(v, bool), "true or false"),
}


def _field(reply: dict, path: str, name: str) -> Any:
    valid, expected = REPLY_FIELDS[name]
    value = reply.get(name)
    if not valid(value):
        raise EpisodeError(f"environment {path}: reply field {name!r}: expected {expected}, got {value!r:.60}",
                           kind="bad_reply")
    return value
