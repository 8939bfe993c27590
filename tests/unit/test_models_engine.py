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
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from astraflow.models import policy_model_dir, wait_for_model
from astraflow.models.factory import make_model
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.rollout.engines.base import SamplingParams
from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.scoring import PolicyScorer
from astraflow.weights.follower import Follower
from astraflow.weights.publisher import Publisher
from tests.conftest import hf_engine, make_run
from tests.unit.engine_parity import check_reloads, teacher_forced


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen2", "tiny", tmp_path_factory.mktemp("m") / "model", seed=0, corpus=["12+7=19"])


@pytest.mark.parametrize("like", ["qwen2.5", "llama3"])
def test_hf_engine_logprobs_and_reloads_match_the_trainer_weights(tmp_path, like):
    model_dir = make_model(like, "tiny", tmp_path / "model", corpus=["What is 12 + 7? 19"] * 20)
    check_reloads(hf_engine(model_dir), model_dir, tmp_path / "weights")


def test_entropy_is_that_of_the_sampled_distribution(model_dir):
    """The trainer reports the entropy of softmax(logits / T): within [0, log V], higher at a
    higher temperature, and log V as T grows without bound; it carries no gradient."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    batch = TokenBatch.of_rows([ModelTokenizer(model_dir).encode_prompt("12+7=19")])
    vocab = model.config.vocab_size
    cold, warm, flat = (PolicyScorer(model, t)(batch).entropy for t in (0.5, 2.0, 1e6))
    assert not cold.requires_grad and cold.shape == batch.targets.shape
    assert (cold >= 0).all() and (cold < warm).all() and (warm <= np.log(vocab) + 1e-5).all()
    torch.testing.assert_close(flat, torch.full_like(flat, np.log(vocab)), atol=1e-4, rtol=0)


def test_right_padded_rows_score_as_if_alone(model_dir):
    """The trainer scores right-padded rows without an attention mask (causal attention keeps
    every real position from seeing the pads that follow it): each row's logprobs equal
    those of the row scored alone, whatever the pad id and the other rows' lengths; and the
    chunked output layer gives the logits' own result whatever the chunk size."""
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = ModelTokenizer(model_dir)
    rows = [tok.encode_prompt(text) for text in ("1+2=3", "12+7=19", "7=")]
    for pad in (tok.eos_ids[0], tok.pad_id):  # any id: the pads must not matter
        together = PolicyScorer(model, 0.7, chunk=3)(TokenBatch.of_rows(rows, pad_id=pad)).logp.detach()
        at = 0
        for row in rows:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([row])).logits[0, :-1] / 0.7
            alone = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row[1:])[:, None])[:, 0]
            torch.testing.assert_close(together[at:at + len(row) - 1], alone, atol=1e-5, rtol=0)
            at += len(row) - 1


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_make_model_writes_an_untied_hf_model_and_tokenizer(tmp_path, arch):
    out = make_model(arch, "tiny", tmp_path / arch, corpus=["a b"])
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == arch and cfg["tie_word_embeddings"] is False
    tok = ModelTokenizer(out)
    assert tok.decode(tok.encode_prompt("What is 12 + 7?")) == "What is 12 + 7?"  # spaces survive
    model = AutoModelForCausalLM.from_pretrained(out)
    assert sum(p.numel() for p in model.parameters()) < 200_000
    with pytest.raises(ValueError, match=r"--size 'huge': expected one of \['small', 'tiny'\]"):
        make_model(arch, "huge", tmp_path / "x")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_match_a_teacher_forced_pass(model_dir, temperature):
    engine = hf_engine(model_dir, seed=1)
    prompts = [engine.tok.encode_prompt(p) for p in ("1+2=", "13-4=", "7+7=")]
    stop = engine.tok.stop_ids

    async def go():
        return await asyncio.gather(*(engine.generate(p, SamplingParams(12, temperature, stop)) for p in prompts))

    outs = asyncio.run(go())
    for p, o in zip(prompts, outs):
        assert len(o.tokens) == len(o.logprobs) > 0 and o.version == 0
        np.testing.assert_allclose(o.logprobs, teacher_forced(engine.model, p, o.tokens, temperature), atol=1e-5)


def test_forced_tokens_are_scored_not_sampled_in_a_shared_batch(model_dir):
    """A reference answer rides in the same batch as sampled requests: its completion is
    exactly the forced tokens (longer than max_tokens, too), with the logprobs a
    teacher-forced pass gives them at the batch's temperature; the sampled requests beside it
    keep theirs."""
    engine = hf_engine(model_dir, seed=3)
    prompt = engine.tok.encode_prompt("12+7=")
    forced = tuple(engine.tok.encode_completion("19"))
    stop = engine.tok.stop_ids

    async def go():
        return await asyncio.gather(engine.generate(prompt, SamplingParams(2, 0.7, stop, forced=forced)),
                                    *(engine.generate(prompt, SamplingParams(6, 0.7, stop)) for _ in range(3)))

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
    pub = Publisher(tmp_path / "weights", "policy", model_dir).publish(trainer_model.state_dict(), 3)
    final = tmp_path / "weights" / "policy" / "v3"
    assert pub.manifest.name == "v3" and not list(final.parent.glob(".*tmp"))
    assert set(load_file(str(final / "model.safetensors"))) == set(trainer_model.state_dict())
    engine = hf_engine(model_dir, seed=2)
    prompt = engine.tok.encode_prompt("5+5=")

    async def go():
        await Follower(final.parent).bring(engine, final)
        return await engine.generate(prompt, SamplingParams(10, 1.0, engine.tok.stop_ids))

    out = asyncio.run(go())
    assert out.version == 3
    np.testing.assert_allclose(out.logprobs, teacher_forced(trainer_model, prompt, out.tokens, 1.0), atol=1e-5)


def test_an_engine_behind_a_damaged_delta_keeps_its_weights_until_the_next_full_version(model_dir, tmp_path):
    """v3's delta is damaged: the engine at v2 is not taken back to the last full version (v1)
    the reader falls back to; v4 is reached only at the next full version, v5, which is then
    installed whole (the engine's tensors are the trainer's, bit for bit)."""
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir)
    policy_dir = tmp_path / "weights" / "policy"
    publisher = Publisher(tmp_path / "weights", "policy", model_dir, full_every=100)
    follower, engine = Follower(policy_dir), hf_engine(model_dir)

    def step(version: int) -> None:
        with torch.no_grad():
            for p in trainer_model.parameters():
                p.add_(torch.randn_like(p) * 0.05 * (torch.rand_like(p) < 0.02))
        publisher.publish(trainer_model.state_dict(), version)

    def engine_is_trainer() -> bool:
        theirs = trainer_model.state_dict()
        return all(torch.equal(t, theirs[n]) for n, t in engine.model.state_dict().items())

    for v in (1, 2):
        step(v)
        asyncio.run(follower.bring(engine, policy_dir / f"v{v}"))
    v2 = {n: t.clone() for n, t in engine.model.state_dict().items()}
    assert engine.version == 2 and engine_is_trainer()
    step(3)
    step(4)
    data = (policy_dir / "v3" / "delta.safetensors").read_bytes()
    (policy_dir / "v3" / "delta.safetensors").write_bytes(data[: len(data) // 2])
    update = asyncio.run(follower.bring(engine, policy_dir / "v4"))
    assert (update.how, update.version) == ("fallback", 1)
    assert engine.version == 2 and all(torch.equal(t, v2[n]) for n, t in engine.model.state_dict().items())
    publisher.full_every = 1
    step(5)
    update = asyncio.run(follower.bring(engine, policy_dir / "v5"))
    assert (update.how, update.version, update.changed) == ("full", 5, None)
    assert engine.version == 5 and engine_is_trainer()


def test_a_version_taken_from_the_collective_channel_installs_the_changed_tensors_and_deltas_follow(model_dir,
                                                                                                   tmp_path):
    trainer_model = AutoModelForCausalLM.from_pretrained(model_dir)
    policy_dir = tmp_path / "weights" / "policy"
    publisher = Publisher(tmp_path / "weights", "policy", model_dir, full_every=100)
    follower, engine = Follower(policy_dir), hf_engine(model_dir)
    first = next(iter(trainer_model.parameters()))

    def step(version: int, params) -> None:
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn_like(p) * 0.05 * (torch.rand_like(p) < 0.02))
        publisher.publish(trainer_model.state_dict(), version)

    step(1, trainer_model.parameters())
    asyncio.run(follower.bring(engine, policy_dir / "v1"))
    step(2, [first])  # as received over the collective channel: a copy of what was published
    received = {n: t.clone() for n, t in publisher.last.items()}
    changed = asyncio.run(follower.take(engine, received, publisher.last_manifest))
    assert changed == {next(iter(publisher.last_manifest.tensors))} and engine.version == 2
    assert all(torch.equal(t, trainer_model.state_dict()[n]) for n, t in engine.model.state_dict().items())
    step(3, trainer_model.parameters())  # the filesystem's delta applies on top of what was received
    update = asyncio.run(follower.bring(engine, policy_dir / "v3"))
    assert (update.how, update.version) == ("delta", 3)
    assert all(torch.equal(t, trainer_model.state_dict()[n]) for n, t in engine.model.state_dict().items())


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
