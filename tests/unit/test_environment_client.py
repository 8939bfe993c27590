"""The environment client against real server processes that misbehave (`tests/misbehaving_env.py`):
a server that stalls past the request timeout, one that dies mid-episode, one that answers
garbage, one that is busy (503) — each costs the episode an `EpisodeError` of the right kind
within its time limit, never a hang or another exception; idempotent calls are retried
within the budget, state-changing ones are not; episodes share pooled keep-alive
connections; the per-episode deadline cuts an episode short."""
from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from typing import Iterator

import pytest

from astraflow.environments.client import EnvironmentClient, EnvLimits, RetryBudget, _field
from astraflow.protocol.messages import Task
from astraflow.workflows.api import EpisodeError
from tests.conftest import REPO

TASK = Task(1, 30.0, "3+4=", "7", 1, ["agent"])
FAST = EnvLimits(request_timeout_s=0.5, retries=2)


@contextlib.contextmanager
def server(mode: str, *args: str) -> Iterator[tuple[subprocess.Popen, str]]:
    with subprocess.Popen([sys.executable, "-m", "tests.misbehaving_env", mode, *args], stdout=subprocess.PIPE,
                          text=True, cwd=REPO) as proc:
        try:
            yield proc, proc.stdout.readline().strip()
        finally:
            proc.kill()


def episode(url: str, limits: EnvLimits = FAST, action: str = "7") -> tuple[EpisodeError | None, EnvironmentClient, float]:
    """One episode (start, one step); the error it ended with, the client, and how long it took."""
    client = EnvironmentClient(url, limits=limits)

    async def run() -> EpisodeError | None:
        try:
            episode_id, _ = await client.start(TASK)
            await client.step(episode_id, action)
        except EpisodeError as e:
            return e
        finally:
            await client.close()
        return None

    t0 = time.monotonic()
    error = asyncio.run(run())
    return error, client, time.monotonic() - t0


def test_a_stalled_server_costs_the_episode_a_timeout_not_a_hang():
    with server("stall", "--stall-s", "30") as (_, url):
        error, client, took = episode(url)
    assert error is not None and error.kind == "timeout" and "/step" in str(error) and "0.5 s" in str(error)
    assert took < 3 and client.retried == 0  # /step changes state: never retried after it was sent


def test_a_server_that_dies_mid_episode_is_unreachable():
    with server("die") as (proc, url):
        error, client, took = episode(url)
        assert proc.wait(5) == 3  # it did die, on /step
    assert error is not None and error.kind == "unreachable" and "/step" in str(error) and took < 3
    assert client.retried == 0  # the request was sent before the connection broke: maybe applied


def test_garbage_replies_are_bad_replies_naming_what_was_expected():
    with server("garbage") as (_, url):
        error, _, _ = episode(url)
    assert error is not None and error.kind == "bad_reply" and "not a JSON object" in str(error)
    assert "proxy error" in str(error)  # the start of what came back, for the operator


def test_a_busy_server_retries_only_idempotent_calls():
    with server("busy") as (_, url):
        error, client, _ = episode(url)
        assert error is not None and error.kind == "http_error" and "503" in str(error)
        assert client.retried == 0  # a 503 on /step: not retried (the step may have happened)

        async def cancel() -> int:
            c = EnvironmentClient(url, limits=FAST)
            try:
                await c.cancel("e0")  # busy twice, then answered: two retries
                return c.retried
            finally:
                await c.close()

        assert asyncio.run(cancel()) == 2


def test_an_unreachable_server_is_retried_within_the_budget():
    """Connection refused: nothing was sent, so even /start is retried, but the retries of a
    client never exceed its banked budget plus what its requests earned."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    client = EnvironmentClient(url, limits=EnvLimits(request_timeout_s=0.5, retries=3, retry_budget=0.1))

    async def many() -> list[str]:
        kinds = []
        for _ in range(30):
            try:
                await client.start(TASK)
            except EpisodeError as e:
                kinds.append(e.kind)
        await client.close()
        return kinds

    assert asyncio.run(many()) == ["unreachable"] * 30
    requests = 30 + client.retried
    assert 10 <= client.retried <= 10 + 0.1 * requests  # the cap banked at the start, then 0.1 per request


def test_retry_budget_earns_a_fraction_per_request():
    budget = RetryBudget(0.5, cap=2)
    assert budget.spend() and budget.spend() and not budget.spend()
    budget.request()
    assert not budget.spend()
    budget.request()
    assert budget.spend()


@pytest.fixture(scope="module")
def healthy() -> Iterator[str]:
    with server("ok") as (_, url):
        yield url


def test_episodes_share_pooled_keep_alive_connections(healthy):
    client = EnvironmentClient(healthy, limits=EnvLimits(connections=4))

    async def one() -> None:
        episode_id, _ = await client.start(TASK)
        await client.step(episode_id, "7")

    async def run() -> tuple[int, int]:
        before = (await client.health())["connections"]  # this client's first connection among them
        for _ in range(5):
            await asyncio.gather(*(one() for _ in range(8)))
        after = (await client.health())["connections"]
        await client.close()
        return before, after

    before, after = asyncio.run(run())
    assert after - before <= 3  # 82 requests, 8 at a time, over at most 4 connections


def test_the_episode_deadline_fails_its_later_calls(healthy):
    client = EnvironmentClient(healthy, limits=EnvLimits(episode_deadline_s=0.3))

    async def run() -> EpisodeError:
        episode_id, _ = await client.start(TASK)
        await client.step(episode_id, "1")  # wrong: the episode goes on
        await asyncio.sleep(0.4)
        try:
            await client.step(episode_id, "7")
        except EpisodeError as e:
            return e
        finally:
            await client.close()
        raise AssertionError("the step past the deadline succeeded")

    error = asyncio.run(run())
    assert error.kind == "deadline" and "env_episode_deadline_s=0.3" in str(error)


@pytest.mark.parametrize("reply", [{"observation": "", "reward": "1", "done": True},
                                   {"observation": "", "reward": 1.0, "done": "yes"}])
def test_a_step_reply_with_a_wrong_field_type_is_a_bad_reply(reply):
    with pytest.raises(EpisodeError, match="reply field") as e:
        for name in ("observation", "reward", "done"):
            _field(reply, "/step", name)
    assert e.value.kind == "bad_reply"
