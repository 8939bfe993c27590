"""`astraflow run configs/search.yaml`, a few steps: real processes, a real tiny model through
its chat template, searching the real BM25 index over several turns. The shards hold whole
episodes whose retrieved documents are context (never trained), rewarded by word F1 of the
answer; the held-out evaluation plays greedy episodes of the same workflow."""
from __future__ import annotations

import json

import pytest

from astraflow.config.loader import load_config
from astraflow.environments.retrieval import corpus_of
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.store.reader import iter_trajectories
from astraflow.tasks.sources import TaskSource
from astraflow.workflows.rewards import token_f1
from tests.integration.test_multi_policy_run import SMALL, astraflow_run

pytestmark = pytest.mark.integration


def test_search_run_stores_episodes_with_documents_as_context(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "warmup.steps=100", "trainer.steps=3", "trainer.batch_size=16", "tasks.group_size=4",
                 "tasks.entities=40", "tasks.heldout=8", "tasks.warmup=60", "rollout.concurrency=4"]
    launcher = astraflow_run("configs/search.yaml", run_dir, overrides)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]
    summary = json.loads(out[out.index("{"):])
    assert summary["steps"] == 3 and summary["failed_episodes"] == {}
    evaluation = json.loads((run_dir / "eval.json").read_text())["eval"]["policy"]
    assert evaluation["metric"] == "episode_reward" and 0.0 <= evaluation["base"] <= 1.0

    cfg = load_config(run_dir / "config.yaml")
    tokenizer, source = ModelTokenizer(run_dir / "model", chat=True), TaskSource(cfg.tasks)
    documents = corpus_of(cfg.tasks)
    records = list(iter_trajectories(run_dir))
    assert len(records) >= 16
    searched = 0
    for r in records:
        meta = r["meta"]
        assert meta["searches"] == len(meta["queries"]) <= 3
        answer, gold = meta["answer"], source.item(r["task_id"]).answer
        assert r["reward"] == pytest.approx(0.0 if answer is None else token_f1(answer, gold))
        trained = r["token_policy"] >= 0
        assert (r["loss_mask"].astype(bool) == trained).all()
        own = tokenizer.decode(r["tokens"][trained])  # what the agent wrote: its actions alone
        context = tokenizer.decode(r["tokens"][~trained])  # the question and what the searches found
        assert all(q in own for q in meta["queries"]) and "<information>" not in own
        if meta["queries"]:
            assert "<information>" in context
        if any(d in context for d in documents):
            searched += 1
            assert not any(d in own for d in documents)
    assert searched > 0  # after its warm-up the agent searches
