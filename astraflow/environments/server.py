"""`astraflow env-server`: an HTTP environment server with an episode protocol like
AgentBench's task servers, and a small built-in text environment.

Protocol (docs/environments.md, for users who serve their own; JSON bodies, `Authorization: Bearer <token>` when the server has a token):
- `POST /start {"prompt", "answer"}` -> `{"episode", "observation"}`;
- `POST /step {"episode", "action"}` -> `{"observation", "reward", "done"}`;
- `POST /cancel {"episode"}` -> `{"ok": true}`; an unknown episode is a 404;
- `GET /health` -> `{"ok": true, "episodes": n}`.
Malformed requests get 400 with an `error` naming the field.

The built-in environment (`arith`): the observation is the task's prompt; an action is a final
answer; a right one ends the episode with reward 1, a wrong one is answered "no;" until
`max_turns` answers, then the episode ends with reward 0. Each step waits a latency drawn
from a lognormal (median, p99): the time a real environment (a test run, a web call) takes.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys

import numpy as np
from aiohttp import web

from astraflow.workflows.api import lognormal

MAX_EPISODES = 100_000  # open episodes kept before the oldest are forgotten


class ArithEnvironment:
    def __init__(self, max_turns: int, latency_median_s: float, latency_p99_s: float, seed: int) -> None:
        self.max_turns = max_turns
        self.latency = (latency_median_s, latency_p99_s)
        self.rng = np.random.default_rng(seed)
        self.episodes: dict[str, dict] = {}
        self.ids = itertools.count()

    def start(self, prompt: str, answer: str) -> dict:
        episode = f"e{next(self.ids)}"
        self.episodes[episode] = {"answer": answer, "turns": 0}
        if len(self.episodes) > MAX_EPISODES:
            self.episodes.pop(next(iter(self.episodes)))
        return {"episode": episode, "observation": prompt}

    async def step(self, episode: str, action: str) -> dict:
        state = self.episodes.get(episode)
        if state is None:
            raise web.HTTPNotFound(text=f'{{"error": "unknown episode {episode}"}}', content_type="application/json")
        if self.latency[0] > 0:
            await asyncio.sleep(lognormal(self.rng, *self.latency))
        state["turns"] += 1
        right = action.strip() == state["answer"].strip()
        done = right or state["turns"] >= self.max_turns
        if done:
            self.episodes.pop(episode, None)
        return {"observation": "" if done else "no;", "reward": float(right), "done": done}

    def cancel(self, episode: str) -> dict:
        self.episodes.pop(episode, None)
        return {"ok": True}


def _field(body: dict, name: str) -> str:
    value = body.get(name)
    if not isinstance(value, str):
        raise web.HTTPBadRequest(text=f'{{"error": "field {name!r}: expected a string"}}', content_type="application/json")
    return value


def build_app(env: ArithEnvironment, token: str = "") -> web.Application:
    async def body_of(request: web.Request) -> dict:
        if token and request.headers.get("Authorization") != f"Bearer {token}":
            raise web.HTTPUnauthorized(text='{"error": "bad or missing bearer token"}', content_type="application/json")
        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text='{"error": "body: expected a JSON object"}',
                                     content_type="application/json") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text='{"error": "body: expected a JSON object"}', content_type="application/json")
        return body

    async def start(request: web.Request) -> web.Response:
        body = await body_of(request)
        return web.json_response(env.start(_field(body, "prompt"), _field(body, "answer")))

    async def step(request: web.Request) -> web.Response:
        body = await body_of(request)
        return web.json_response(await env.step(_field(body, "episode"), _field(body, "action")))

    async def cancel(request: web.Request) -> web.Response:
        body = await body_of(request)
        return web.json_response(env.cancel(_field(body, "episode")))

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True, "episodes": len(env.episodes)})

    app = web.Application(client_max_size=1 << 20)
    app.add_routes([web.post("/start", start), web.post("/step", step), web.post("/cancel", cancel),
                    web.get("/health", health)])
    return app


async def serve(args: argparse.Namespace) -> None:
    env = ArithEnvironment(args.max_turns, args.latency_median_s, args.latency_p99_s, args.seed)
    runner = web.AppRunner(build_app(env, os.environ.get("ASTRAFLOW_ENV_TOKEN", "")), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the port chosen when --port 0
    print(f"http://{args.host}:{port}", flush=True)  # the first stdout line: where to connect
    await asyncio.Event().wait()


def main(args: argparse.Namespace) -> int:
    try:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass
    print("environment server stopped", file=sys.stderr)
    return 0
