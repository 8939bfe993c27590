"""Memory at LLM scale without changing the mathematics: chunked (and checkpointed) output
layers, token-budget micro-batches with gradient accumulation, and a batch that must divide
across ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from astraflow.bench.payload import random_trajectory
from astraflow.config.loader import ConfigError, parse_config
from astraflow.models.factory import make_model
from astraflow.protocol import messages as m
from astraflow.trainer import scoring
from astraflow.trainer.batch import TokenBatch
from astraflow.trainer.scoring import PolicyScorer
from astraflow.trainer.torch_backend import TorchBackend


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("qwen2.5", "tiny", tmp_path_factory.mktemp("m") / "model",
                      corpus=["Tom has 3 apples and buys 5 more. How many apples? \\boxed{8}"] * 20)


def served_batch(vocab: int, n: int = 24, seed: int = 0) -> m.BatchReply:
    rng = np.random.default_rng(seed)
    trajs = []
    for i in range(n):
        t = random_trajectory(rng, "policy", int(rng.integers(6, 30)), prompt_tokens=int(rng.integers(2, 5)), version=3)
        trajs.append(m.Trajectory("policy", (t.tokens % vocab).astype(np.int32), t.logprobs, t.loss_mask, t.versions,
                                  t.token_policy, t.reward))
    return m.BatchReply(4, False, m.TrajectoryBatch.from_trajectories(trajs), np.arange(n), np.zeros(n, np.int64),
                        rng.standard_normal(n).astype(np.float32), np.zeros(n, np.float32), np.ones(n, np.float32))


@pytest.mark.parametrize("checkpointed", [False, True])
def test_chunked_output_layer_gives_the_gradient_of_full_logits(model_dir, monkeypatch, checkpointed):
    """Whatever the chunk size, and whether chunks are recomputed in the backward pass, the
    logprobs, the entropy and the gradient are those of one full-vocabulary pass."""
    monkeypatch.setattr(scoring, "CHECKPOINT_BYTES", 0 if checkpointed else 1 << 40)
    rows = [[int(x) for x in np.random.default_rng(i).integers(0, 300, 12 + i)] for i in range(3)]
    batch = TokenBatch.of_rows(rows)
    results = []
    for chunk in (1, 5, 10_000):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        scores = PolicyScorer(model, 0.7, chunk=chunk)(batch)
        (scores.logp * torch.linspace(-1, 1, len(scores.logp))).sum().backward()
        results.append((scores.logp.detach(), scores.entropy, model.model.layers[0].mlp.up_proj.weight.grad.clone(),
                        model.lm_head.weight.grad.clone() if not model.config.tie_word_embeddings
                        else model.model.embed_tokens.weight.grad.clone()))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_no_full_vocabulary_tensor_is_kept_for_the_backward_pass(model_dir, monkeypatch):
    """With checkpointed chunks, nothing the backward pass keeps has a chunk's worth of logits
    or more: the (batch, length, vocabulary) tensor never exists, its chunks only transiently."""
    monkeypatch.setattr(scoring, "CHECKPOINT_BYTES", 0)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    vocab = model.config.vocab_size
    batch = TokenBatch.of_rows([list(range(1, 65))] * 8)
    saved: list[tuple[int, ...]] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        PolicyScorer(model, 1.0, chunk=16)(batch).logp.sum().backward()
    weight = model.lm_head.weight.numel()  # the output layer's weight itself (or its transpose) is no logits
    assert saved and not [s for s in saved if vocab in s and int(np.prod(s)) != weight]
    monkeypatch.setattr(scoring, "CHECKPOINT_BYTES", 1 << 40)  # kept: a chunk's logits, never more
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        PolicyScorer(model, 1.0, chunk=16)(batch).logp.sum().backward()
    assert max(int(np.prod(s)) for s in saved if vocab in s and int(np.prod(s)) != weight) == 16 * vocab


def test_micro_batches_by_token_budget_give_the_same_update(model_dir):
    """One optimizer step on a served batch, cut into micro-batches of at most 40 tokens,
    accumulates the gradient of one pass over the batch (the token-mean over all of it: no
    clipping here, so a wrong normaliser would show), and so the same weights after it."""
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).config.vocab_size
    reply = served_batch(vocab)
    grads, weights, stats = [], [], []
    for budget in (0, 40):
        cfg = parse_config("policies: [{name: policy}]\n"
                           f"trainer: {{max_tokens_per_microbatch: {budget}, lr: 0.01, grad_clip: 1.0e+9}}\n")
        backend = TorchBackend(model_dir, cfg, "policy", 0, 1)
        stats.append(backend.train_step(reply, 4, 0.01))
        grads.append({k: p.grad.clone() for k, p in backend.model.named_parameters()})
        weights.append({k: v.clone() for k, v in backend.hf_state_dict().items()})
    assert stats[0]["version_lag"] == 0.0  # step 4 trains on version 3: no lag
    for key in ("loss", "entropy", "is_weight", "grad_norm"):
        assert stats[0][key] == pytest.approx(stats[1][key], rel=1e-4), key
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-7, rtol=1e-4)
        # AdamW divides by the root of the squared gradient: where that is near 0, float noise
        # in the gradient moves an update by a little (1% of a step here)
        torch.testing.assert_close(weights[0][name], weights[1][name], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("extra, match", [
    ("trainer: {world: 3, batch_size: 64}", r"trainer.batch_size: 64 samples do not divide across 3 data-parallel ranks"),
    ("trainer: {world: 2, batch_size: 8, minibatches: 8}", r"each data-parallel rank's 4 samples cannot make minibatches=8"),
    ("trainer: {world: 2}\npolicies: [{name: policy, batch_size: 33}]", r"policies.policy.batch_size: 33 samples"),
])
def test_a_batch_that_does_not_divide_across_ranks_is_a_config_error(extra, match):
    text = extra if "policies" in extra else extra + "\npolicies: [{name: policy}]"
    with pytest.raises(ConfigError, match=match):
        parse_config(text)
