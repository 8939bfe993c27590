"""Decoupled PPO, the batch layout the trainer computes it on, and the learning-rate schedule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from astraflow.bench.payload import random_trajectory
from astraflow.config.schema import TrainerConfig
from astraflow.protocol import messages as m
from astraflow.trainer.batch import micro_batches, pack_rows
from astraflow.trainer.loss import decoupled_ppo_loss, forward_kl
from astraflow.trainer.lr import lr_at


def test_on_policy_gradient_is_the_advantage_weighted_score():
    logp = torch.log(torch.tensor([0.5, 0.25], requires_grad=True))
    adv = torch.tensor([2.0, 2.0])
    loss, sums = decoupled_ppo_loss(logp, logp.detach(), logp.detach(), adv, 0.2, 2.0, normalizer=2)
    loss.backward()
    assert sums.clipped == 0 and abs(sums.mean("is_weight") - 1) < 1e-6 and abs(sums.mean("behaviour_kl")) < 1e-6
    assert torch.isclose(loss, torch.tensor(-2.0))  # -(ratio 1 * A) averaged over tokens


def test_stale_tokens_are_reweighted_and_the_weight_is_truncated():
    prox = torch.log(torch.tensor([0.5, 0.5]))
    behaviour = torch.log(torch.tensor([0.25, 0.05]))  # weights 2 and 10 -> truncated to 3
    logp = prox.clone().requires_grad_(True)
    loss, sums = decoupled_ppo_loss(logp, prox, behaviour, torch.ones(2), 0.2, 3.0, normalizer=2)
    assert abs(sums.mean("is_weight") - 2.5) < 1e-5 and torch.isclose(loss, torch.tensor(-2.5))


def test_micro_batches_accumulate_to_the_gradient_of_one_batch():
    """Each micro-batch adds its tokens' sum over the step's token count: cut anywhere, the
    accumulated gradient is the one batch's."""
    logp = torch.log(torch.tensor([0.5, 0.2, 0.7, 0.1]))
    prox, behaviour, adv = logp - 0.05, logp - 0.2, torch.tensor([1.0, -0.5, 2.0, 0.3])
    whole = logp.clone().requires_grad_(True)
    decoupled_ppo_loss(whole, prox, behaviour, adv, 0.2, 2.0, normalizer=4)[0].backward()
    parts = logp.clone().requires_grad_(True)
    for cut in (slice(0, 1), slice(1, 4)):
        decoupled_ppo_loss(parts[cut], prox[cut], behaviour[cut], adv[cut], 0.2, 2.0, normalizer=4)[0].backward()
    torch.testing.assert_close(parts.grad, whole.grad)


def test_forward_kl_keeps_pulling_up_a_token_the_policy_dropped():
    """KL(pi_ref || pi): zero at the reference; for a token pi has all but dropped, the
    gradient on its logit stays about pi - pi_ref (a pull that does not vanish with pi, as an
    entropy bonus's does)."""
    ref = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0]), -1)
    assert forward_kl(ref, ref.clone()).abs() < 1e-7
    logits = torch.tensor([5.0, 1.0, -9.0], requires_grad=True)
    kl = forward_kl(ref, torch.log_softmax(logits, -1))
    kl.backward()
    p = torch.softmax(logits.detach(), -1)
    assert torch.isclose(kl, (ref.exp() * (ref - p.log())).sum())
    torch.testing.assert_close(logits.grad, p - ref.exp())
    assert logits.grad[2] < -0.05


def test_micro_batches_hold_the_trained_targets_shifted_with_their_masks():
    rng = np.random.default_rng(0)
    trajs = [random_trajectory(rng, "policy", n, prompt_tokens=3, version=4) for n in (5, 8, 6)]
    reply = m.BatchReply(1, False, m.TrajectoryBatch.from_trajectories(trajs), np.array([0, 1, 2]),
                         np.array([0, 0, 0]), np.array([0.5, -0.5, 1.5], np.float32), np.zeros(3, np.float32),
                         np.ones(3, np.float32))
    (one,) = micro_batches(reply, np.arange(3), 0, pad_id=0)
    assert one.input_ids.shape == (3, 8) and one.rows.tolist() == [0, 2, 1]  # by length
    assert one.tokens == 2 + 3 + 5  # the generated tokens of each row: prompt tokens are no targets
    assert one.targets[:2].tolist() == trajs[0].tokens[3:].tolist()
    assert one.behaviour_logp[:2].tolist() == trajs[0].logprobs[3:].tolist()
    assert one.advantages.tolist() == [0.5] * 2 + [1.5] * 3 + [-0.5] * 5
    assert (one.versions == 4).all() and (one.input_ids[0, 5:] == 0).all()  # right padding
    small = micro_batches(reply, np.arange(3), 13, pad_id=0)  # 13 tokens: rows of 5 and 6 fit together
    assert [mb.rows.tolist() for mb in small] == [[0, 2], [1]] and sum(mb.tokens for mb in small) == one.tokens
    assert pack_rows(np.array([9, 2, 30]), 10).__len__() == 3  # a row over the budget goes alone


def test_cosine_schedule_warms_up_decays_to_its_floor_and_constant_stays():
    cfg = TrainerConfig(steps=100, lr=1e-3, lr_schedule="cosine", lr_warmup_steps=10, lr_min_ratio=0.1)
    rates = [lr_at(cfg, s) for s in range(1, 101)]
    assert rates[0] == pytest.approx(1e-4) and rates[9] == pytest.approx(1e-3)  # linear warm-up
    assert all(a >= b for a, b in zip(rates[9:], rates[10:]))  # then never rises
    assert rates[-1] == pytest.approx(1e-4) and lr_at(cfg, 150) == pytest.approx(1e-4)  # the floor, also past the end
    assert lr_at(TrainerConfig(steps=100, lr=5e-4), 77) == 5e-4
