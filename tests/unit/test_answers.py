"""`astraflow answers`: reward per reference answer over versions, from real shards of a run."""
from __future__ import annotations

import json

import numpy as np

from astraflow.analysis.answers import answers_report, format_answers
from astraflow.store.shards import ShardStore
from astraflow.store.writer import RowBatch, StoreOptions
from astraflow.tasks.sources import TaskSource
from tests.conftest import make_run

VERSIONS = 10


def rows_for(task_ids: list[int], versions: list[int], rewards: list[float], first_id: int,
             guided: bool = False) -> RowBatch:
    n, tokens = len(task_ids), 3
    return RowBatch(
        tokens={"tokens": np.ones(n * tokens, np.int32), "logprobs": np.zeros(n * tokens, np.float32),
                "loss_mask": np.ones(n * tokens, np.uint8), "versions": np.repeat(versions, tokens).astype(np.int32),
                "token_policy": np.zeros(n * tokens, np.int8)},
        rows={"sample_id": np.arange(first_id, first_id + n, dtype=np.int64),
              "task_id": np.array(task_ids, np.int64), "episode_id": np.arange(n, dtype=np.int64),
              "group_id": np.zeros(n, np.int64), "policy": np.zeros(n, np.uint8),
              "worker": np.full(n, b"w0", "S64"), "length": np.full(n, tokens, np.int32),
              "reward": np.array(rewards, np.float32), "guided": np.full(n, guided, np.uint8),
              "weight": np.ones(n, np.float32),
              "gen_s": np.zeros(n, np.float32),
              "t_commit": np.ones(n), "version_min": np.array(versions, np.int32),
              "version_max": np.array(versions, np.int32), "version_at_commit": np.array(versions, np.int32)},
        meta=[json.dumps({}).encode()] * n)


def test_answers_split_the_reward_by_answer_and_find_lost_and_never_learned_ones(tmp_path):
    run = make_run(tmp_path)
    source = TaskSource(run.config.tasks)
    task_ids = list(range(300))
    answers = [source.item(t).answer for t in task_ids]
    common = sorted(set(answers), key=answers.count)
    lost, never = common[-1], common[-2]  # the two most frequent answers, so both are shown

    def reward(answer: str, version: int) -> float:
        if answer == never:
            return 0.0
        if answer == lost:
            return 1.0 if version < VERSIONS // 2 else 0.0
        return float(version >= 2)  # learned after version 2

    store = ShardStore(run.path / "shards", ("policy",), StoreOptions())
    for version in range(VERSIONS):
        store.append(rows_for(task_ids, [version] * len(task_ids),
                              [reward(a, version) for a in answers], version * len(task_ids)))
    never_tasks = [t for t, a in zip(task_ids, answers) if a == never]
    # reference answers for the never-learned answer's tasks: counted, never rewarded as samples
    store.append(rows_for(never_tasks, [0] * len(never_tasks), [1.0] * len(never_tasks), 10_000, guided=True))
    store.close()

    report = answers_report(run.path, buckets=5, top=1000)
    p = report["policies"]["policy"]
    assert p["versions"] == ["v0-1", "v2-3", "v4-5", "v6-7", "v8-9"]
    assert p["lost"] == [lost] and p["never"] == [never]
    assert p["lost_share"] == round(answers.count(lost) / len(answers), 4)
    by_answer = {r["answer"]: r for r in p["answers"]}
    assert sum(r["samples"] for r in p["answers"]) == len(task_ids) * VERSIONS
    assert by_answer[lost]["reward"] == [1.0, 1.0, 0.5, 0.0, 0.0]
    assert by_answer[never]["reward"] == [0.0] * 5
    assert by_answer[never]["guided"] == len(never_tasks) and by_answer[lost]["guided"] == 0
    other = next(a for a in by_answer if a not in (lost, never))
    assert by_answer[other]["reward"] == [0.0, 1.0, 1.0, 1.0, 1.0]
    numeric = [float(r["answer"]) for r in p["answers"]]
    assert numeric == sorted(numeric)  # numbers in numeric order, not as strings

    text = format_answers(report)
    assert f"rewarded at first, below 1% at the end: {lost}" in text

    top2 = answers_report(run.path, buckets=5, top=2)["policies"]["policy"]
    second = sorted(map(answers.count, set(answers)))[-2]
    assert len(top2["answers"]) == 2 and all(answers.count(r["answer"]) >= second for r in top2["answers"])
    assert "(the 2 most frequent of" in format_answers(answers_report(run.path, top=2))
