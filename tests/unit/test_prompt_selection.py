"""Pre-rollout prompt selection: who is skipped, how often, and the reward weights that keep
the generated reward the reward of the whole task distribution."""
from __future__ import annotations

import pytest

from astraflow.config.schema import SelectionConfig
from astraflow.dataflow.buffers import PolicyBuffer
from astraflow.dataflow.selection import PromptSelection
from astraflow.dataflow.state import DataflowState
from astraflow.protocol import messages as m
from astraflow.store.reader import load_rows
from tests.conftest import make_run, store_sample
from tests.unit.test_dataflow_state import Clock, group, register

ON = ["selection.skip_zero_advantage=true", "tasks.group_size=4"]


def draw(sel: PromptSelection, task: int) -> float | None:
    """The weight the task is handed out with, or None when it is skipped."""
    return sel.weight(task) if sel.keep(task) else None


def test_a_prompt_is_kept_with_probability_explore_to_its_streak_until_it_teaches_again():
    cfg = SelectionConfig(skip_zero_advantage=True, explore=0.5, max_streak=2)
    sel = PromptSelection(cfg, seed=0, prompt_of=lambda task: task)  # task i is prompt i
    assert all(draw(sel, 7) == 1.0 for _ in range(100)) and sel.skipped == 0
    for _ in range(5):  # five filtered groups in a row: the streak counts as max_streak
        sel.observe(7, zero_advantage=True)
    weights = [draw(sel, 7) for _ in range(4000)]
    kept = [w for w in weights if w is not None]
    assert 0.22 < len(kept) / 4000 < 0.28 and set(kept) == {4.0}
    assert sel.skipped == 4000 - len(kept)
    sel.observe(7, zero_advantage=False)  # one informative group: always kept again
    assert all(draw(sel, 7) == 1.0 for _ in range(100))


def test_selection_off_keeps_every_prompt():
    sel = PromptSelection(SelectionConfig(), seed=0, prompt_of=lambda task: task)
    sel.observe(3, zero_advantage=True)
    assert all(draw(sel, 3) == 1.0 for _ in range(100)) and sel.skipped == 0


def test_the_generated_reward_is_weighted_by_selection():
    buf = PolicyBuffer("p", max_staleness=1, capacity=100)
    store_sample(buf, 0, filtered=True, reward=1.0, weight=3.0)
    store_sample(buf, 1, task=1, reward=0.0, weight=1.0)
    assert buf.generated_reward() == (pytest.approx(0.75), 2)


def test_the_rank_skips_solved_prompts_weights_the_kept_ones_and_rebuilds_streaks_after_a_restart(tmp_path):
    run = make_run(tmp_path, ON + ["selection.explore=0.5", "selection.max_streak=1",
                                   "policies.policy.buffer_capacity=100000"])
    clock = Clock()
    state = DataflowState(run.path, run.config, clock=clock)
    state.recover()
    w = register(state)
    first = state.handle(m.Lease(w, 2)).tasks
    solved, taught = (state.source.index(t.task_id) for t in first)
    state.handle(m.Commit(w, first[0].task_id, group(first[0].task_id, [1, 1, 1, 1])))  # filtered
    state.handle(m.Commit(w, first[1].task_id, group(first[1].task_id, [0, 1, 1, 0])))
    assert state.selection.streak == {solved: 1}
    n = len(state.source.train)
    leased: list[int] = []
    while state.tasks.next_id < 9 * n:  # eight more epochs: each prompt comes up eight times
        leased += [t.task_id for t in state.handle(m.Lease(w, 64)).tasks]
    prompts = [state.source.index(t) for t in leased]
    assert prompts.count(taught) == 8 and 1 <= prompts.count(solved) <= 6  # each time with probability 0.5
    assert state.selection.skipped == state.tasks.next_id - len(leased) - 2 == 8 - prompts.count(solved)
    assert state.handle(m.Status()).status["tasks"]["skipped"] == state.selection.skipped
    weights = {state.source.index(t): w for t, w in state.selection.weights.items()}
    assert weights[solved] == 2.0 and weights[taught] == 1.0
    again = next(t for t in leased if state.source.index(t) == solved)
    clock.t += run.config.dataflow.lease_s + 1
    state.tick()  # every lease expires: `again` comes back as a late commit, with its weight
    w = register(state)  # silent that long, the worker was declared dead too: it registers again
    state.handle(m.Commit(w, again, group(again, [1, 1, 1, 1])))  # filtered again: a streak of 2
    assert state.buffers["policy"].generated_reward()[0] == pytest.approx((4 + 2 + 2 * 4) / (4 + 4 + 2 * 4))
    state.flush()
    state.close()
    rows = load_rows(run.path)
    assert rows.groupby("task_id")["weight"].first().to_dict() == {first[0].task_id: 1, first[1].task_id: 1, again: 2}
    state = DataflowState(run.path, run.config, clock=Clock())
    state.recover()
    assert state.selection.streak == {solved: 2}
    state.close()
