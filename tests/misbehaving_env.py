"""An environment server that misbehaves on purpose: the built-in server's protocol and
environment (`astraflow.environments.server`) behind a middleware that, on every `--every`-th
`/step`, does what `MODE` says:
- `ok`: nothing (the control);
- `stall`: sleeps `--stall-s` before answering (past the client's request timeout);
- `garbage`: answers 200 with a body that is not JSON;
- `die`: the process exits at once, the request unanswered;
- `busy`: answers 503 (a /cancel too, on its first two tries, to exercise retries).
`GET /health` also reports `connections`: the distinct client connections (peer ports) seen,
so a test can tell pooled keep-alive connections from one connection per request.

`python -m tests.misbehaving_env MODE [--every N] [--stall-s S] [--port P]`; prints its URL as
the first line of stdout, as `astraflow env-server` does.
"""
from __future__ import annotations

import argparse
import asyncio
import os

from aiohttp import web

from astraflow.environments.server import ArithEnvironment, build_app


def misbehaving_app(mode: str, every: int, stall_s: float) -> web.Application:
    app = build_app(ArithEnvironment(max_turns=3, latency_median_s=0.0, latency_p99_s=0.0, seed=0))
    seen: set[int] = set()
    counts = {"/step": 0, "/cancel": 0}

    @web.middleware
    async def misbehave(request: web.Request, handler):
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer:
            seen.add(peer[1])
        if request.path == "/health":
            return web.json_response({"ok": True, "connections": len(seen)})
        if request.path in counts:
            counts[request.path] += 1
        if request.path == "/cancel" and mode == "busy" and counts["/cancel"] <= 2:
            return web.json_response({"error": "busy"}, status=503)
        if request.path == "/step" and counts["/step"] % every == 0:
            if mode == "stall":
                await request.read()  # the body first: a client that gave up meanwhile is no server error
                await asyncio.sleep(stall_s)
            elif mode == "garbage":
                return web.Response(text="<html>proxy error</html>", status=200)
            elif mode == "die":
                os._exit(3)
            elif mode == "busy":
                return web.json_response({"error": "busy"}, status=503)
        return await handler(request)

    app.middlewares.append(misbehave)
    return app


async def serve(args: argparse.Namespace) -> None:
    runner = web.AppRunner(misbehaving_app(args.mode, args.every, args.stall_s), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port)
    await site.start()
    print(f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("ok", "stall", "garbage", "die", "busy"))
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--stall-s", type=float, default=30.0)
    p.add_argument("--port", type=int, default=0)
    asyncio.run(serve(p.parse_args()))
