"""Decoupled PPO, the batch layout the trainer computes it on, and the learning-rate schedule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from astraflow.bench.payload import random_trajectory
from astraflow.config.schema import TrainerConfig
from astraflow.protocol import messages as m
from astraflow.trainer.batch import to_tensors
from astraflow.trainer.loss import decoupled_ppo_loss, forward_kl
from astraflow.trainer.lr import lr_at


def test_on_policy_gradient_is_the_advantage_weighted_score():
    logp = torch.log(torch.tensor([[0.5, 0.25]], requires_grad=True))
    adv = torch.tensor([2.0])
    mask = torch.tensor([[1.0, 1.0]])
    loss, stats = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, mask, 0.2, 2.0)
    loss.backward()
    assert stats.clip_frac == 0 and abs(stats.is_weight - 1) < 1e-6 and abs(stats.behaviour_kl) < 1e-6
    assert torch.isclose(loss, torch.tensor(-2.0))  # -(ratio 1 * A) averaged over tokens


def test_stale_tokens_are_reweighted_and_the_weight_is_truncated():
    prox = torch.log(torch.tensor([[0.5, 0.5]]))
    behaviour = torch.log(torch.tensor([[0.25, 0.05]]))  # weights 2 and 10 -> truncated to 3
    logp = prox.clone().requires_grad_(True)
    loss, stats = decoupled_ppo_loss(logp, prox, behaviour, torch.tensor([1.0]), torch.ones(1, 2), 0.2, 3.0)
    assert abs(stats.is_weight - 2.5) < 1e-5 and torch.isclose(loss, torch.tensor(-2.5))


def test_masked_tokens_do_not_contribute():
    logp = torch.zeros(1, 3, requires_grad=True)
    entropy = torch.tensor([[9.0, 0.5, 9.0]])
    loss, stats = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), torch.tensor([1.0]),
                                     torch.tensor([[0.0, 1.0, 0.0]]), 0.2, 2.0, entropy)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 2] == 0 and logp.grad[0, 1] != 0
    assert stats.entropy == 0.5  # reported over trained tokens only


def test_forward_kl_keeps_pulling_up_a_token_the_policy_dropped():
    """KL(pi_ref || pi): zero at the reference; for a token pi has all but dropped, the
    gradient on its logit stays about pi - pi_ref (a pull that does not vanish with pi, as an
    entropy bonus's does); masked positions do not count."""
    ref = torch.log_softmax(torch.tensor([[[2.0, 1.0, 0.0], [2.0, 1.0, 0.0]]]), -1)
    mask = torch.tensor([[1.0, 0.0]])
    assert forward_kl(ref, ref.clone(), mask).abs() < 1e-7
    logits = torch.tensor([[[5.0, 1.0, -9.0], [-9.0, -9.0, 9.0]]], requires_grad=True)
    kl = forward_kl(ref, torch.log_softmax(logits, -1), mask)
    kl.backward()
    p = torch.softmax(logits[0, 0].detach(), -1)
    assert torch.isclose(kl, (ref[0, 0].exp() * (ref[0, 0] - p.log())).sum())  # the masked row is left out
    torch.testing.assert_close(logits.grad[0, 0], p - ref[0, 0].exp())
    assert logits.grad[0, 0, 2] < -0.05 and (logits.grad[0, 1] == 0).all()


def test_batch_targets_are_shifted_with_their_masks():
    rng = np.random.default_rng(0)
    trajs = [random_trajectory(rng, "policy", n, prompt_tokens=3, version=4) for n in (5, 8)]
    reply = m.BatchReply(1, False, m.TrajectoryBatch.from_trajectories(trajs), np.array([0, 1]), np.array([0, 0]),
                         np.array([0.5, -0.5], np.float32), np.zeros(2, np.float32), np.ones(2, np.float32))
    b = to_tensors(reply, pad_id=0)
    assert b.input_ids.shape == (2, 8) and b.targets.shape == (2, 7)
    assert b.attention_mask[0].tolist() == [1] * 5 + [0] * 3
    assert b.targets[1].tolist() == trajs[1].tokens[1:].tolist()
    assert b.loss_mask[0].tolist() == [0, 0, 1, 1, 0, 0, 0]  # 3 prompt tokens, 2 generated, padding
    assert torch.allclose(b.behaviour_logp[1], torch.from_numpy(trajs[1].logprobs[1:]))
    assert b.advantages.tolist() == [0.5, -0.5]


def test_cosine_schedule_warms_up_decays_to_its_floor_and_constant_stays():
    cfg = TrainerConfig(steps=100, lr=1e-3, lr_schedule="cosine", lr_warmup_steps=10, lr_min_ratio=0.1)
    rates = [lr_at(cfg, s) for s in range(1, 101)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)  # linear warm-up
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))  # then never rises
    assert rates[-1] == pytest.approx(1e-4) and lr_at(cfg, 150) == pytest.approx(1e-4)  # the floor, also past the end
    assert lr_at(TrainerConfig(steps=100, lr=5e-4), 77) == 5e-4
