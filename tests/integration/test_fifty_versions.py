"""Fifty versions of a real model through the filesystem channel into real engines.

A tiny Qwen2 trained by AdamW (fp32 master weights, lr 1e-5, a language-model loss on random
tokens) publishes every step in bf16 — the first version full, the other 49 sparse deltas —
and a worker's `Follower` brings each into the engine (hf, and vLLM's in-place swap). After
every version the worker holds exactly the trainer's published bits (checksums; for the hf
engine its parameters too), and every tenth version (and the last) the engine's logprobs —
sampled and forced tokens — equal a teacher-forced pass of the published weights."""
from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from astraflow.models.factory import make_model
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.weights.follower import Follower
from astraflow.weights.publisher import Publisher
from astraflow.weights.tensors import xxh3
from tests.conftest import require
from tests.unit.engine_parity import teacher_forced

CORPUS = ["What is 12 + 7? 19", "Tom has 3 apples."] * 20
VERSIONS = 50


def build_engine(kind: str, model_dir):
    if kind == "vllm":
        require("vllm")
        from astraflow.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(model_dir, seed=0)
    from astraflow.rollout.engines.hf import HFEngine

    return HFEngine(model_dir)  # threads: the process's own (a count set here would stay for vLLM later)


def checksums(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: xxh3(t.detach().to(torch.bfloat16).contiguous()) for name, t in tensors.items()}


def check_logprobs(engine, teacher, tok: ModelTokenizer, version: int) -> None:
    prompts = [tok.encode_prompt(f"What is {i} + {i + 3}?") for i in range(4)]
    forced = tuple(tok.encode_completion("19"))

    async def go():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(6, 1.0, tok.stop_ids)) for p in prompts),
                                    engine.generate(prompts[0], SamplingParams(6, 1.0, tok.stop_ids, forced=forced)))

    *sampled, scored = asyncio.run(go())
    for prompt, out in [*zip(prompts, sampled), (prompts[0], scored)]:
        assert out.version == version
        torch.testing.assert_close(torch.from_numpy(out.logprobs),
                                   torch.from_numpy(teacher_forced(teacher, prompt, out.tokens, 1.0)),
                                   atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["hf", "vllm"])
def test_fifty_delta_versions_keep_the_engine_on_the_trainers_bits(tmp_path, kind):
    model_dir = make_model("qwen2", "tiny", tmp_path / "model", corpus=CORPUS)
    engine = build_engine(kind, model_dir)
    tok = ModelTokenizer(model_dir)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()  # the published weights
    optim = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    publisher = Publisher(tmp_path / "weights", "policy", model_dir, torch.bfloat16, full_every=VERSIONS + 1)
    follower = Follower(tmp_path / "weights" / "policy")
    generator = torch.Generator().manual_seed(0)
    kinds = []
    for version in range(1, VERSIONS + 1):
        ids = torch.randint(trainer.config.vocab_size, (2, 32), generator=generator)
        optim.zero_grad(set_to_none=True)
        trainer(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        pub = publisher.publish(trainer.state_dict(), version)
        kinds.append(pub.manifest.kind)
        update = asyncio.run(follower.bring(engine, tmp_path / "weights" / "policy" / pub.manifest.name))
        assert update.version == engine.version == version
        published = checksums(publisher.last)
        assert checksums(follower.reader.state) == published
        if kind == "hf":
            held = engine.model.state_dict()
            assert checksums({name: held[name] for name in published}) == published
        if version % 10 == 0 or version == 1:
            with torch.no_grad():
                teacher.load_state_dict({n: t.float() for n, t in publisher.last.items()}, strict=False)
            check_logprobs(engine, teacher, tok, version)
    assert kinds == ["full"] + ["delta"] * (VERSIONS - 1)  # small steps: every later version a delta
    engine.close()
