"""Tiny models from config, the hf engine's logprobs, and in-place weight reloads."""
from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from astraflow.models import policy_model_dir, wait_for_model
from astraflow.models.factory import make_model
from astraflow.models.tokenizer import TextCodec
from astraflow.rollout.engines.base import SamplingParams
from astraflow.rollout.engines.hf import HFEngine
from astraflow.trainer.batch import TrainBatch, token_logprobs, token_scores
from astraflow.weights.fs import load_state_dict, path_of, publish
from tests.conftest import make_run


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen2", "tiny", tmp_path_factory.mktemp("m") / "model", seed=0, corpus=["12+7=19"])


def teacher_forced(model, prompt: list[int], tokens: np.ndarray, temperature: float) -> np.ndarray:
    """The trainer's own scoring (`token_logprobs`) of an engine's completion: with the engine's
    logprobs equal to it, the on-policy importance ratio is exactly 1."""
    seq = torch.tensor([prompt + tokens.tolist()])
    batch = TrainBatch(seq, torch.ones_like(seq), seq[:, 1:], *[None] * 5)
    with torch.no_grad():
        return token_logprobs(model, batch, temperature)[0, len(prompt) - 1:].numpy()


def test_entropy_is_that_of_the_sampled_distribution(model_dir):
    """The trainer reports the entropy of softmax(logits / T): within [0, log V], higher at a
    higher temperature, and log V as T grows without bound; it carries no gradient."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    seq = torch.tensor([TextCodec(model_dir).encode_prompt("12+7=19")])
    batch = TrainBatch(seq, torch.ones_like(seq), seq[:, 1:], *[None] * 5)
    vocab = model.config.vocab_size
    cold, warm, flat = (token_scores(model, batch, t)[1] for t in (0.5, 2.0, 1e6))
    assert not cold.requires_grad and cold.shape == batch.targets.shape
    assert (cold >= 0).all() and (cold < warm).all() and (warm <= np.log(vocab) + 1e-5).all()
    torch.testing.assert_close(flat, torch.full_like(flat, np.log(vocab)), atol=1e-4, rtol=0)


def test_right_padded_rows_score_as_if_alone(model_dir):
    """The trainer scores right-padded rows without an attention mask (causal attention keeps
    every real position from seeing the pads that follow it): each row's logprobs equal
    those of the row scored alone, whatever the pad id and the other rows' lengths."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    codec = TextCodec(model_dir)
    rows = [codec.encode_prompt(text) for text in ("1+2=3", "12+7=19", "7=")]
    width = max(map(len, rows))
    seq = torch.full((len(rows), width), codec.eos_id)  # any id: the pads must not matter
    for i, row in enumerate(rows):
        seq[i, : len(row)] = torch.tensor(row)
    padded = TrainBatch(seq, (seq != -1).long(), seq[:, 1:], *[None] * 5)
    with torch.no_grad():
        together = token_logprobs(model, padded, 0.7)
    for i, row in enumerate(rows):
        alone = teacher_forced(model, row[:1], np.array(row[1:]), 0.7)
        torch.testing.assert_close(together[i, : len(row) - 1], torch.from_numpy(alone), atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_make_model_writes_an_untied_hf_model_and_tokenizer(tmp_path, arch):
    out = make_model(arch, "tiny", tmp_path / arch, corpus=["a b"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is False
    codec = TextCodec(out)
    assert codec.decode(codec.encode_prompt("What is 12 + 7?")) == "What is 12 + 7?"  # spaces survive
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) < 200_000
    with pytest.raises(ValueError, match=r"--size 'huge': expected one of \['tiny', 'small'\]"):
        make_model(arch, "huge", tmp_path / "x")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_a_teacher_forced_pass(model_dir, temperature):
    engine = HFEngine(model_dir, seed=1)
    prompts = [engine.codec.encode_prompt(p) for p in ("1+2=", "13-4=", "7+7=")]

    async def go():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(12, temperature)) for p in prompts))

    outs = asyncio.run(go())
    for p, o in zip(prompts, outs):
        assert len(o.tokens) == len(o.logprobs) > 0 and o.version == 0
        np.testing.assert_allclose(o.logprobs, teacher_forced(engine.model, p, o.tokens, temperature), atol=1e-5)


def test_forced_tokens_are_scored_not_sampled_in_a_shared_batch(model_dir):
    """A reference answer rides in the same batch as sampled requests: its completion is
    exactly the forced tokens (longer than max_tokens, too), with the logprobs a
    teacher-forced pass gives them at the batch's temperature; the sampled requests beside it
    keep theirs."""
    engine = HFEngine(model_dir, seed=3)
    prompt = engine.codec.encode_prompt("12+7=")
    forced = tuple(engine.codec.encode_completion("19"))

    async def go():
        return await asyncio.gather(engine.generate(prompt, SamplingParams(2, 0.7, forced=forced)),
                                    *(engine.generate(prompt, SamplingParams(6, 0.7)) for _ in range(3)))

    scored, *sampled = asyncio.run(go())
    assert scored.tokens.tolist() == list(forced) and scored.finished and scored.version == 0
    np.testing.assert_allclose(scored.logprobs, teacher_forced(engine.model, prompt, scored.tokens, 0.7), atol=1e-5)
    for o in sampled:
        np.testing.assert_allclose(o.logprobs, teacher_forced(engine.model, prompt, o.tokens, 0.7), atol=1e-5)


def test_reload_serves_exactly_the_published_weights(model_dir, tmp_path):
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():  # a "training step": every tensor moves, lm_head included
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    uri = publish(trainer_model.state_dict(), model_dir, tmp_path / "weights", "policy", 3)
    final = path_of(uri)
    assert final.name == "v3" and not list(final.parent.glob(".*tmp"))
    assert set(load_state_dict(uri)) == set(trainer_model.state_dict())
    engine = HFEngine(model_dir, seed=2)
    prompt = engine.codec.encode_prompt("5+5=")

    async def go():
        await engine.load_weights(final, 3)
        return await engine.generate(prompt, SamplingParams(10, 1.0))

    out = asyncio.run(go())
    assert out.version == 3
    np.testing.assert_allclose(out.logprobs, teacher_forced(trainer_model, prompt, out.tokens, 1.0), atol=1e-5)


def test_a_component_started_with_the_run_waits_for_its_model(tmp_path, model_dir):
    """`wait_for_model` returns only once the preparation has renamed the finished directory
    into place; a configured model used as it is (no warm-up) is never waited for."""
    run = make_run(tmp_path)
    target = policy_model_dir(run.path, run.config, "policy")
    tmp = target.with_name(target.name + ".tmp")
    shutil.copytree(model_dir, tmp)  # a preparation half-way: the directory is not in place yet
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(wait_for_model(run.path, run.config, "policy", poll_s=0.01)))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive() and not got
    tmp.rename(target)
    waiter.join(timeout=5)
    assert got == [target]
    (tmp_path / "b").mkdir()
    configured = make_run(tmp_path / "b", [f"model.path={tmp_path / 'nowhere'}", "warmup.steps=0"])
    assert wait_for_model(configured.path, configured.config, "policy") == tmp_path / "nowhere"
