"""Task sources, the lease table and per-policy buffers, each alone."""
from __future__ import annotations

import numpy as np
import pytest

from astraflow.config.loader import ConfigError
from astraflow.config.schema import TaskSourceConfig
from astraflow.dataflow.buffers import CONSUMED, DROPPED, READY, PolicyBuffer, group_stats
from astraflow.dataflow.leases import TaskSet, TaskTable
from astraflow.tasks.sources import TaskSource
from tests.conftest import store_sample


def test_arithmetic_source_is_deterministic_with_disjoint_heldout():
    a, b = TaskSource(TaskSourceConfig(seed=3)), TaskSource(TaskSourceConfig(seed=3))
    assert [a.item(i) for i in range(1500)] == [b.item(i) for i in range(1500)]
    assert len(a.heldout) == 200
    assert not {x.prompt for x in a.heldout} & {x.prompt for x in a.train}
    epoch = [a.item(i).prompt for i in range(len(a.train))]
    assert sorted(epoch) == sorted(x.prompt for x in a.train)  # one epoch = every training item once
    item = a.item(0)
    assert eval(item.prompt.rstrip("=")) == int(item.answer)  # noqa: S307 - our own arithmetic


def test_jsonl_source_names_file_and_line_of_a_bad_row(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "1+1=", "answer": "2"}\n\n{"prompt": 5}\n')
    with pytest.raises(ConfigError, match=rf"{path}:3: field 'prompt': expected a non-empty string, got int 5"):
        TaskSource(TaskSourceConfig(kind="jsonl", path=str(path), heldout=0))
    path.write_text('{"prompt": "1+1=", "answer": 2}\n{oops\n')
    with pytest.raises(ConfigError, match=rf"{path}:2: not valid JSON"):
        TaskSource(TaskSourceConfig(kind="jsonl", path=str(path), heldout=0))
    path.write_text("".join(f'{{"prompt": "q{i}", "answer": {i}}}\n' for i in range(10)))
    src = TaskSource(TaskSourceConfig(kind="jsonl", path=str(path), heldout=3))
    assert len(src.heldout) == 3 and len(src.train) == 7 and src.item(0).answer.isdigit()


def test_leases_expire_renew_and_requeue_first():
    t = TaskTable()
    a, b = t.take(), t.take()
    t.lease(a, "w1", now=0.0, duration=10.0, versions={})
    t.lease(b, "w1", now=0.0, duration=10.0, versions={})
    assert t.renew(b, "w1", now=9.0, duration=10.0)
    assert not t.renew(b, "w2", now=9.0, duration=10.0)  # only the holder renews
    assert t.expire(now=10.5) == [a]
    assert t.take() == a  # expired work goes out first
    assert t.expire(now=18.9) == [] and t.expire(now=19.1) == [b]
    t.lease(a, "w2", 20.0, 10.0, {})
    t.complete(a)
    assert t.expire(now=100.0) == []  # a committed task never comes back
    assert a in t.done and a not in t.leased and a not in t.queued


def test_task_table_recovery_requeues_everything_not_done():
    t = TaskTable()
    t.recover(done=TaskSet({0, 2, 5}), high_water=8)
    assert list(t.queued) == [1, 3, 4, 6, 7] and t.next_id == 8


def test_task_table_recovery_keeps_the_task_limit():
    """Task ids are journalled as a high-water mark in blocks of 1024: a rank restarted early in
    a run of `max_tasks` 80 re-queued every id up to the mark and handed out 1,024 tasks (a
    flaky integration test: its buffer then filled and the workers waited for good)."""
    t = TaskTable(limit=4)
    t.recover(done=TaskSet({0, 2}), high_water=1026)
    assert list(t.queued) == [1, 3] and [t.take(), t.take(), t.take()] == [1, 3, None] and t.exhausted


def test_task_limit_exhausts():
    t = TaskTable(limit=2)
    assert [t.take(), t.take(), t.take()] == [0, 1, None] and t.exhausted
    t.lease(0, "w", 0.0, 1.0, {})
    t.release(0)
    assert not t.exhausted and t.take() == 0 and t.exhausted


def _buffer(n: int, versions: list[int] | None = None, staleness: int = 1, newest_first: bool = False) -> PolicyBuffer:
    buf = PolicyBuffer("p", max_staleness=staleness, capacity=100, newest_first=newest_first)
    for i in range(n):
        store_sample(buf, i, task=i // 2, version=(versions or [0] * n)[i], payload=object())
    return buf


def test_take_waits_for_a_full_batch_and_drops_stale_samples():
    buf = _buffer(6, versions=[0, 0, 2, 2, 3, 3], staleness=1)
    assert buf.take(step=1, n=5, trainer_version=3) is None  # 0,0 are stale: only 4 fresh
    assert buf.counts["dropped_stale"] == 2 and buf.samples.state[0] == DROPPED
    assert buf.buffered == 4 and buf.take(1, 4, 3) == [2, 3, 4, 5]


def test_newest_first_serves_the_last_stored_and_clears_the_stale_old_end():
    buf = _buffer(8, versions=[0, 0, 2, 0, 2, 2, 3, 3], staleness=1, newest_first=True)
    assert buf.take(step=1, n=3, trainer_version=3) == [7, 6, 5]
    # the old end is cleared up to the first fresh sample; the stale one behind it stays
    assert buf.counts["dropped_stale"] == 2 and list(buf.ready) == [2, 3, 4]
    assert buf.take(2, 3, 3) is None  # 3 is stale too: two fresh ones, kept in their order
    assert list(buf.ready) == [2, 4] and buf.counts["dropped_stale"] == 3
    store_sample(buf, 8, task=4, version=3, payload=object())
    assert buf.take(2, 3, 3) == [8, 4, 2]
    # a restarted trainer gets the served samples next, in the order they were served
    assert buf.trainer_restarted(resume_step=0) == []
    assert buf.take(1, 3, 3) == [7, 6, 5] and buf.take(2, 3, 3) == [8, 4, 2]


def test_consume_checks_what_was_served_and_restart_replays():
    buf = _buffer(8)
    s1, s2 = buf.take(1, 4, 0), buf.take(2, 4, 0)
    assert buf.consume(1, s2) is not None  # not what step 1 was served
    assert buf.consume(1, s1) is None and buf.samples.state[s1[0]] == CONSUMED
    assert buf.consume(3, s1) == "step 3 was never served"  # nor consumed again under another step
    # trainer crashes after step 1 was consumed and step 2 served; it resumes from step 0
    assert buf.trainer_restarted(resume_step=0) == [1]
    assert buf.samples.state[s2[0]] == READY and list(buf.ready)[:4] == s2


def test_a_finished_trainer_exerts_no_backpressure_and_its_late_samples_are_unused():
    buf = PolicyBuffer("p", max_staleness=1, capacity=4, steps=1)
    for i in range(4):
        store_sample(buf, i, payload=object())
    assert not buf.has_room(1)  # full while its trainer still needs samples
    assert buf.consume(1, buf.take(1, 4, 0)) is None and buf.finished
    assert buf.has_room(1000)  # done: the other policies' episodes must not wait for it
    store_sample(buf, 9, task=1, version=1, payload=object())
    assert buf.samples.state[9] == DROPPED and 9 not in buf.payloads and buf.cached_tokens == 0
    assert buf.counts["unused"] == 1 and buf.buffered == 0


def test_arithmetic_formats():
    def first(**kw):
        src = TaskSource(TaskSourceConfig(max_operand=99, heldout=0, **kw))
        return {i.prompt: i.answer for i in src.train}

    plain = first(ops="+")
    assert plain["9+15="] == "24" and len(plain) == 100 * 100
    padded = first(ops="+", pad_operands=True, reverse_answer=True)
    assert padded["09+15="] == "42" and padded["99+99="] == "891"
    assert first(ops="-", answer="units")["23-9="] == "4"
    assert first(answer="parity")["7+8="] == "1"


def test_group_advantages_with_and_without_the_std():
    rewards = np.array([4.0, 0.0, 0.0, 0.0])  # a weighted right answer among three wrong ones
    mean, std, adv = group_stats(rewards)
    assert mean == 1.0 and adv == pytest.approx((rewards - 1.0) / np.sqrt(3.0), rel=1e-5)
    _, _, plain = group_stats(rewards, scale=False)  # Dr. GRPO: the scale of the rewards stays
    assert plain.tolist() == [3.0, -1.0, -1.0, -1.0]
    assert group_stats(rewards * 10, scale=False)[2].tolist() == [30.0, -10.0, -10.0, -10.0]


def test_generated_reward_is_since_the_last_read_and_carried_over_an_empty_interval():
    buf = PolicyBuffer("p", max_staleness=1, capacity=100)
    assert np.isnan(buf.generated_reward()[0])  # nothing generated yet
    for i, reward in enumerate([1.0, 0.0, 1.0, 1.0]):
        store_sample(buf, i, task=i, reward=reward)
    store_sample(buf, 9, reward=1.0, guided=True)  # not generated
    assert buf.generated_reward() == (0.75, 4)
    assert buf.generated_reward() == (0.75, 0)  # a step served from the surplus: no NaN
    store_sample(buf, 10, task=5)
    assert buf.generated_reward() == (0.0, 1) and buf.counts["guided"] == 1
