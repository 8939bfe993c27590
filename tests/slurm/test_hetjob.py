"""The Slurm path on a real local cluster: the heterogeneous job, a killed rollout rank, a
trainer group that loses a rank, scale-out and scancel of rollout arrays, drain, preemption
warning and requeue.

Each test is a real run (the checked-in script with sbatch, or `astraflow-launch` → sbatch →
srun → MPI start-up → supervised components) on the quickstart task with the hf engine and
short settings.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astraflow.analysis.audit import audit
from astraflow.store.reader import load_rows
from tests.slurm.conftest import (acknowledged_commits, declared_dead, events, in_queue, kill_tree, launch, launch_cli, node_pids,
                                  sbatch_by_hand, status, summary, trainer_step, wait_for)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

GROUP = 8  # tasks.group_size of the quickstart
CRED_EXPIRE_S = 10  # AuthInfo=cred_expire of tools/local-slurm.sh


def running(job: str) -> bool:
    states = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], capture_output=True, text=True).stdout.split()
    return bool(states) and all(s == "RUNNING" for s in states)


def assert_each_task_stored_once(run_dir: Path) -> None:
    """GROUP sampled records per task, and at most one guided reference (an all-wrong group)."""
    rows = load_rows(run_dir)
    per_task = rows[rows["guided"] == 0].groupby("task_id").size()
    assert (per_task == GROUP).all(), per_task[per_task != GROUP]
    guided = rows[rows["guided"] == 1].groupby("task_id").size()
    assert (guided == 1).all() and set(guided.index) <= set(per_task.index), guided[guided != 1]


def test_hetjob_runs_on_its_partitions_and_survives_a_killed_rollout_rank(tmp_path: Path, cancel_jobs):
    run_dir = tmp_path / "het run"  # a space in the path, as users' paths have
    cancel_jobs(run_dir)
    # the checked-in script by hand, two rollout tasks by sbatch's per-component options
    job = sbatch_by_hand(run_dir, "trainer.steps=80", "rollout.workers=2",
                         per_component=(f"--output={run_dir.parent}/slurm-%j.out", ":", ":", "--ntasks=2"))
    wait_for("both rollout ranks registered and training under way",
             lambda: len(events(run_dir, "register")) >= 2 and trainer_step(run_dir) >= 5, 120, run_dir)

    # SIGKILL rollout rank 3 (its node process and its worker): a dead node, not a clean exit
    victim = node_pids(run_dir, procid=3)
    assert victim, "rollout rank 3 not found"
    kill_tree(victim)
    killed_wall = time.time()
    killed_at = trainer_step(run_dir)
    # The rank's own log line, not a status poll: a short run may end (and its rank stop
    # answering) within a poll of the declaration, which made this wait time out in CI.
    declared = wait_for("the killed worker declared dead and its leases back in the queue",
                        lambda: declared_dead(run_dir, f"{job}.3"), 30, run_dir)
    dead_s = declared[0] - killed_wall
    print(f"SIGKILLed rollout rank: declared dead, {declared[1]} leases handed out again after {dead_s:.1f}s")
    assert dead_s <= 5 + 5, f"{dead_s:.1f}s > heartbeat timeout 5 s + 5 s"
    wait_for("the run to finish", lambda: not in_queue(job), 240, run_dir)

    s = summary(run_dir)
    assert s["steps"] == 80 and killed_at < 80
    # roles ran where they were asked to: the job record, the journal, the shards
    record = json.loads((run_dir / "rendezvous" / f"job-{job}.json").read_text())
    assert [(t["role"], t["partition"]) for t in record["tasks"]] == [
        ("dataflow", "cpu"), ("trainer", "gpu-h100"), ("rollout", "gpu-a100"), ("rollout", "gpu-a100")]
    assert {e["partition"] for e in events(run_dir, "ready")} == {"gpu-h100"}
    registered = {e["worker"]: e["partition"] for e in events(run_dir, "register")}
    assert set(registered.values()) == {"gpu-a100"} and {w.split(".r")[0] for w in registered} == {f"{job}.2", f"{job}.3"}
    rows = load_rows(run_dir)
    assert set(rows.worker) <= set(registered)
    assert_each_task_stored_once(run_dir)
    # the surviving worker committed after the kill: the run finished on its work
    assert acknowledged_commits(run_dir, f"{job}.2") > 0
    assert "Killed" in (run_dir.parent / f"slurm-{job}.out").read_text()


@pytest.mark.parametrize("backend", [["trainer.world=2"], ["trainer.backend=megatron", "trainer.tp=2"]],
                         ids=["torch-dp2", "megatron-tp2"])
def test_a_trainer_group_that_loses_a_rank_restarts_as_a_whole(tmp_path: Path, cancel_jobs, backend):
    """Two trainer tasks form one torch.distributed world through a TCP store at rank 0's node
    (from the MPI start-up, not a file on the shared filesystem): data parallel with the torch
    backend, one tensor-parallel model (tp = 2) with the megatron backend."""
    run_dir = tmp_path / "group"
    cancel_jobs(run_dir)
    job = launch(run_dir, "trainer.steps=30", "trainer.checkpoint_every=5", *backend)
    wait_for("the two-rank trainer under way", lambda: trainer_step(run_dir) >= 6, 150, run_dir)
    record = json.loads((run_dir / "rendezvous" / f"job-{job}.json").read_text())
    assert [t["role"] for t in record["tasks"]].count("trainer") == 2

    # SIGKILL the trainer process of rank 1 (step task 2); its supervisor and rank 0's restart
    # the group under a new generation, and both resume from the last checkpoint
    rank1 = [p for p in node_pids(run_dir, procid=2)][1:]
    assert rank1, "trainer rank 1 not found"
    kill_tree(rank1)
    wait_for("the run to finish", lambda: not in_queue(job), 240, run_dir)

    assert summary(run_dir)["steps"] == 30
    ready = events(run_dir, "ready")
    assert len(ready) >= 2 and all(e["world"] == 2 for e in ready) and ready[-1]["resume_step"] >= 5
    generations = sorted((run_dir / "rendezvous").glob("torch-policy-*.gen*"))
    assert generations, "the group's generation never moved"
    for rank in (0, 1):
        log = (run_dir / "logs" / f"trainer-policy-r{rank}.log").read_text()
        assert f"rank {rank}, gloo, rendezvous at tcp://" in log, log[-2000:]
    assert audit(run_dir)["ok"]


def test_scale_out_then_scancel_and_drain_lose_nothing(tmp_path: Path, cancel_jobs):
    run_dir = tmp_path / "elastic"
    cancel_jobs(run_dir)
    job = launch(run_dir, "trainer.steps=400", "rollout.workers=1", "rollout.concurrency=4",
                 "weights.channel=collective")
    wait_for("training under way", lambda: trainer_step(run_dir) >= 3, 120, run_dir)

    t0 = time.time()
    out = launch_cli("scale", str(run_dir), "--add", "2", "--partition", "gpu-h100")
    array = out.split("rollout array ")[1].split()[0]
    joined = wait_for("both array tasks registered",
                      lambda: (r := [e for e in events(run_dir, "register") if e["base"].startswith(f"{array}_")])
                      and len(r) == 2 and r, 90, run_dir)
    join_s = max(e["time"] for e in joined) - t0
    assert {e["partition"] for e in joined} == {"gpu-h100"}
    assert join_s < 60, f"array workers took {join_s:.1f}s to register"
    wait_for("trajectories from the array workers",
             lambda: (load_rows(run_dir).worker.str.startswith(f"{array}_")).sum() > 0, 60, run_dir)
    # the weight channels: the het job's rollout task receives versions from the trainer over
    # the collective group; the array workers joined later and follow the filesystem
    logs = run_dir / "logs"
    wait_for("versions received over the collective channel",
             lambda: "(collective, " in (logs / f"rollout-{job}.2.log").read_text(), 30, run_dir)
    wait_for("the array workers loading versions from the filesystem",
             lambda: all("loaded weights v" in (logs / f"rollout-{array}_{i}.log").read_text() for i in (0, 1)),
             30, run_dir)
    assert not any("(collective, " in (logs / f"rollout-{array}_{i}.log").read_text() for i in (0, 1))
    # `astraflow status`: the jobs, and workers and throughput per partition
    report = json.loads(subprocess.run([sys.executable, "-m", "astraflow.cli.main", "status", str(run_dir), "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert {j["job_id"] for j in report["jobs"]["queue"]} >= {f"{array}_0", f"{array}_1", f"{job}+0"}
    assert report["dataflow"]["workers_by_partition"] == {"gpu-a100": 1, "gpu-h100": 2}
    assert report["dataflow"]["throughput_per_partition"]["gpu-h100"]["trajectories_per_s"] > 0

    # scancel the array as an admin would: its leases must be handed out again in time
    requeued_before = status(run_dir)["tasks"]["requeued"]
    t_cancel = time.monotonic()
    subprocess.run(["scancel", array], check=True)
    st = wait_for("the array workers gone and their leases back in the queue",
                  lambda: (s := status(run_dir)) and not any(w["alive"] and w["base"].startswith(f"{array}_")
                                                             for w in s["workers"]["list"]) and s, 30, run_dir)
    handed_back_s = time.monotonic() - t_cancel
    print(f"scancel of a 2-task array: workers gone, leases back in the queue after {handed_back_s:.2f}s")
    assert handed_back_s <= 5 + 5, f"leases handed back after {handed_back_s:.1f}s (heartbeat timeout 5 s + 5 s)"
    assert st["tasks"]["requeued"] >= requeued_before
    assert all(w["leases"] == 0 for w in st["workers"]["list"] if w["base"].startswith(f"{array}_"))

    # a drained worker finishes or hands back what it holds, then its task is cancelled
    out = launch_cli("scale", str(run_dir), "--add", "1", "--partition", "gpu-a100")
    second = out.split("rollout array ")[1].split()[0]
    wait_for("the second array's worker committing",
             lambda: (load_rows(run_dir).worker.str.startswith(f"{second}_")).sum() > 0, 90, run_dir)
    out = launch_cli("scale", str(run_dir), "--remove", "1")
    assert f"{second}_0" in out
    wait_for("the drained task gone from the queue", lambda: not in_queue(second), 30, run_dir)
    assert any(e["bases"] == [f"{second}_0"] for e in events(run_dir, "drain"))

    subprocess.run(["scancel", job], check=True)
    wait_for("the job to end", lambda: not in_queue(job), 60, run_dir)
    # nothing acknowledged is missing, nothing is stored twice. A cancelled worker may have had
    # a commit stored whose acknowledgement it never read (stored >= acknowledged); a drained
    # one finished cleanly (stored == acknowledged).
    rows = load_rows(run_dir)
    stored = rows.groupby(rows.worker.str.split(".r").str[0]).task_id.nunique()
    for base in (f"{array}_0", f"{array}_1"):
        assert stored[base] >= acknowledged_commits(run_dir, base) > 0, base
    assert stored[f"{second}_0"] == acknowledged_commits(run_dir, f"{second}_0") > 0
    assert_each_task_stored_once(run_dir)


def test_preemption_warning_then_requeue_resumes_the_run(tmp_path: Path, cancel_jobs):
    run_dir = tmp_path / "requeue"
    cancel_jobs(run_dir)
    job = launch(run_dir, "trainer.steps=80", "rollout.workers=1", "trainer.checkpoint_every=50")
    wait_for("training past step 12", lambda: trainer_step(run_dir) >= 12, 150, run_dir)

    # Slurm's warning signal, as --signal=USR1@N delivers it: trainers checkpoint, workers leave
    subprocess.run(["scancel", "--signal=USR1", job], check=True)  # the steps, not the batch shell
    wait_for("the job to stop on the warning", lambda: not in_queue(job), 60, run_dir)
    checkpoints = sorted(int(p.stem.split("-")[1]) for p in (run_dir / "checkpoints" / "policy").glob("step-*.pt"))
    warned_at = checkpoints[-1]
    assert warned_at >= 12 and warned_at % 50 != 0, f"no checkpoint at the warning: {checkpoints}"
    assert events(run_dir, "leave"), "the worker did not hand back its leases on the warning"
    assert [e["step"] for e in events(run_dir, "stopped")] == [warned_at], "the rank stopped before the trainer"

    # the scheduler requeues it (a preemption); the same job id, so the same run directory
    subprocess.run(["scontrol", "requeue", job], check=True)
    # Slurm holds a requeued job for a minute; it may safely start once the old job's
    # credentials have expired (the local cluster's cred_expire: 10 s), so lift the hold then
    time.sleep(CRED_EXPIRE_S + 2)
    subprocess.run(["scontrol", "update", f"jobid={job}", "starttime=now"], check=True)
    wait_for("the requeued job running", lambda: running(job), 60, run_dir)
    wait_for("the requeued run to finish", lambda: (run_dir / "summary.json").exists() and not in_queue(job), 240, run_dir)

    ready = events(run_dir, "ready")
    assert [e["resume_step"] for e in ready][0] == 0 and ready[-1]["resume_step"] == warned_at
    assert summary(run_dir)["steps"] == 80
    assert_each_task_stored_once(run_dir)


def test_a_job_shaped_unlike_its_config_stops_at_once_saying_why(tmp_path: Path, cancel_jobs):
    run_dir = tmp_path / "misfit"
    cancel_jobs(run_dir)
    out = run_dir.parent / "misfit.out"
    # the checked-in script has one trainer task; this config wants two trainer ranks
    job = sbatch_by_hand(run_dir, "trainer.world=2", per_component=(f"--output={out}",))
    wait_for("the job to end", lambda: not in_queue(job), 60)
    log = out.read_text()
    assert "het group 1 has 1 tasks; the config needs trainer.world × policies = 2 × 1" in log
    assert log.count("start-up failed on the dataflow task") == 3  # every task heard it, none hung
    assert not (run_dir / "summary.json").exists()
