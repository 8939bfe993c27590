"""The rollout worker's side of the environment protocol (see `server.py`).

Any failure to reach the server, a timeout or an error status raises `EpisodeError`, so the
worker hands the task back instead of crashing. `builtin()` starts the built-in server as a
child process on loopback with a fresh bearer token and connects to it.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import sys

import aiohttp

from astraflow.config.schema import WorkflowConfig
from astraflow.protocol.messages import Task
from astraflow.workflows.api import EpisodeError

TIMEOUT_S = 30.0


class EnvironmentClient:
    def __init__(self, url: str, token: str = "", process: asyncio.subprocess.Process | None = None) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.process = process
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
        return cls(line.decode().strip(), token, proc)

    async def call(self, path: str, body: dict) -> dict:
        if self.session is None:
            self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S), headers=self.headers)
        try:
            async with self.session.post(f"{self.url}{path}", json=body) as reply:
                data = await reply.json(content_type=None)
                if reply.status != 200:
                    raise EpisodeError(f"environment {path}: HTTP {reply.status}: {data.get('error', data)}")
                return data
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise EpisodeError(f"environment {path} failed: {e!r}") from None

    async def start(self, task: Task) -> tuple[str, str]:
        reply = await self.call("/start", {"prompt": task.prompt, "answer": task.answer})
        return reply["episode"], reply["observation"]

    async def step(self, episode: str, action: str) -> tuple[str, float, bool]:
        reply = await self.call("/step", {"episode": episode, "action": action})
        return reply["observation"], float(reply["reward"]), bool(reply["done"])

    async def cancel(self, episode: str) -> None:
        try:
            await self.call("/cancel", {"episode": episode})
        except EpisodeError:
            pass  # the server is gone: nothing to clean up there

    async def check(self, task: Task, answer: str) -> None:
        """One round-trip that submits an answer (solver_verifier's `env_check`)."""
        episode, _ = await self.start(task)
        await self.step(episode, answer)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
