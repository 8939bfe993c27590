"""Multi-policy and agentic runs through `astraflow run`: real processes, real models.

- solver + verifier: two trainers with their own batch sizes advance independently; a worker
  that hosts only the solver gets no task (episodes need both); no token of one policy is
  ever trained by the other.
- a tool-using agent in the sync schedule against an environment server that stalls past the
  request timeout, then dies mid-run: episodes that lose it are recorded with their reason,
  handed back and run again; the worker is never restarted.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from astraflow.analysis.metrics import read_metrics
from astraflow.sandbox import Sandbox
from astraflow.store.journal import replay
from astraflow.store.reader import ShardReader, iter_shards, load_rows
from tests.conftest import REPO

pytestmark = pytest.mark.integration

SMALL = ["warmup.steps=20", "engine.kind=hf", "trainer.checkpoint_every=5", "launcher.backoff_s=0.2",
         "dataflow.lease_s=10", "dataflow.heartbeat_timeout_s=5"]


def astraflow_run(config: str, run_dir: Path, overrides: list[str], **popen) -> subprocess.Popen:
    sets = [a for o in overrides for a in ("--set", o)]
    return subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "run", config, "--run-dir", str(run_dir),
                             "--quiet", "--json", *sets],  # the summary as one line of JSON
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def consumed_by_policy(run_dir: Path) -> dict[str, dict[int, list[int]]]:
    out: dict[str, dict[int, list[int]]] = {}
    for ev in replay(run_dir / "journal"):
        if ev["ev"] == "consumed":
            out.setdefault(ev["policy"], {})[ev["step"]] = ev["ids"]
    return out


def test_solver_and_verifier_train_independently_on_their_own_tokens(tmp_path):
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "trainer.steps=6", "trainer.batch_size=32", "policies.1.batch_size=16",
                 "policies.1.steps=10", "rollout.workers=2", "rollout.concurrency=8",
                 'rollout.pools=[{"workers": 1, "policies": ["solver", "verifier"]}, '
                 '{"workers": 1, "policies": ["solver"]}]']
    launcher = astraflow_run("configs/multi_policy.yaml", run_dir, overrides)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]
    summary = json.loads(out[out.index("{"):])
    assert summary["policies"]["solver"]["steps"] == 6 and summary["policies"]["verifier"]["steps"] == 10
    assert [r["samples"] for r in read_metrics(run_dir, "verifier")] == [16] * 10
    assert [r["samples"] for r in read_metrics(run_dir, "solver")] == [32] * 6
    assert {p.name for p in (run_dir / "weights" / "verifier").glob("v*")} >= {"v10"}
    assert not (run_dir / "weights" / "solver" / "v7").exists()  # its own number of steps
    assert {"metric", "base", "last"} <= set(summary["eval"]["verifier"])

    df = load_rows(run_dir)
    assert set(df["worker"].str.split(".").str[0]) == {"local-0"}  # local-1 hosts the solver only
    contrast = df[df["guided"] == 1]  # the config's verifier_contrast: verdicts on answers the solver did not give
    assert len(contrast) and (contrast["policy"] == "verifier").all()
    assert contrast.groupby("task_id").size().max() <= 2  # at most one right and one wrong per group
    consumed = consumed_by_policy(run_dir)
    for policy in ("solver", "verifier"):
        ids = [s for step in consumed[policy].values() for s in step]
        assert len(ids) == len(set(ids))
        assert (df.set_index("sample_id").loc[ids, "policy"] == policy).all()  # served to its own trainer
    for path in iter_shards(run_dir):
        reader = ShardReader(path)
        for row in np.linspace(0, reader.n_rows - 1, 40).astype(int):
            t = reader.trajectory(int(row))
            own = t["loss_mask"].astype(bool)
            index = {"solver": 0, "verifier": 1}[t["policy"]]
            assert own.any() and (t["token_policy"][own] == index).all()
        reader.close()


def test_cotrain_chat_runs_both_policies_on_vllm_engines_in_one_worker(tmp_path):
    """configs/cotrain_chat.yaml as shipped (vllm-batch): one worker holds the solver's and the
    verifier's vLLM engines, in one process (their batches crashed it when they overlapped);
    the solver's all-wrong groups get the reference answer, the verifier both classes."""
    run_dir = tmp_path / "run"
    small = [o for o in SMALL if not o.startswith("engine.kind=")]
    overrides = [*small, "trainer.steps=3", "trainer.batch_size=32", "policies.1.batch_size=32",
                 "tasks.warmup=200", "tasks.heldout=16", "rollout.concurrency=8"]
    launcher = astraflow_run("configs/cotrain_chat.yaml", run_dir, overrides)
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err[-3000:]
    summary = json.loads(out[out.index("{"):])
    assert summary["policies"]["solver"]["steps"] == 3 and summary["policies"]["verifier"]["steps"] == 3
    assert summary["failed_episodes"] == {}
    df = load_rows(run_dir)
    guided = df[df["guided"] == 1]
    assert set(guided["policy"]) == {"solver", "verifier"}  # reference answers and contrast verdicts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_server(port: int, *stall: str) -> subprocess.Popen:
    """The built-in server, or with `stall` (`--every N`) one that stalls every Nth step."""
    cmd = (["-m", "tests.misbehaving_env", "stall", "--stall-s", "5", *stall] if stall else
           ["-m", "astraflow.cli.main", "env-server", "--latency-median-s", "0.05", "--latency-p99-s", "0.3"])
    proc = subprocess.Popen([sys.executable, *cmd, "--port", str(port)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert proc.stdout.readline().startswith("http://")
    return proc


@pytest.mark.skipif(Sandbox.check() is not None, reason=str(Sandbox.check()))
def test_agent_run_survives_its_environment_server_stalling_and_dying(tmp_path):
    """A server that stalls every 20th step past the request timeout, is then killed and later
    restarted: those episodes fail (`timeout`, `unreachable`), are recorded with their reason
    and handed back; the worker goes on and is never restarted."""
    port = free_port()
    # every 20th: a task's group takes ~6 steps, so most tasks still finish (at every 4th
    # almost none did, and the run made no step in 180 s)
    server = env_server(port, "--every", "20")
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "warmup.steps=60", "tasks.workflow=multi_turn_tool", "policies.0.role=agent",
                 "trainer.steps=6", "trainer.batch_size=16", "tasks.group_size=4", "engine.max_tokens=8",
                 "rollout.concurrency=4", "schedule.mode=sync", f"workflow.environment=http://127.0.0.1:{port}",
                 "workflow.reference_guidance=false", "workflow.env_request_timeout_s=1"]
    launcher = astraflow_run("configs/quickstart.yaml", run_dir, overrides)
    try:
        deadline = time.monotonic() + 180
        while not read_metrics(run_dir, "policy"):
            assert launcher.poll() is None, launcher.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "no training step"
            time.sleep(0.2)
        server.kill()
        server.wait()
        time.sleep(3)  # episodes fail meanwhile and go back to the queue
        server = env_server(port)
        out, err = launcher.communicate(timeout=240)
    finally:
        server.kill()
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "handing it back" in log and "(restart 1)" not in log
    failures = [json.loads(line) for path in (run_dir / "logs").glob("episode-failures-*.jsonl")
                for line in path.read_text().splitlines()]
    kinds = {f["kind"] for f in failures}
    assert {"timeout", "unreachable"} <= kinds, failures
    assert all("/step" in f["reason"] or "/start" in f["reason"] for f in failures)
    summary = json.loads(out[out.index("{"):])
    assert summary["failed_episodes"] == {k: sum(f["kind"] == k for f in failures) for k in kinds}
    df = load_rows(run_dir)
    assert df.groupby("task_id").size().eq(4).all()  # a handed-back task is stored once, whole
    assert summary["policies"]["policy"]["steps"] == 6
