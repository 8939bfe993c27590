"""The optional metrics backends, Weights & Biases (offline) and MLflow (a file store in the
run directory): a trainer's rows, a restarted trainer replaying a step, a best completion
and the evaluation's scores go through `open_sinks` / `record_eval` as the trainer and
`astraflow eval` send them, and are read back with each library's own reader: W&B's
`wandb leet inspect --json` (its reader of the offline `.wandb` transaction log; `wandb.Api`
needs the server) and MLflow's `MlflowClient.get_metric_history`. Neither needs a network.
A run that enables a backend whose package is missing is refused before it starts, naming
the key and the `pip install` line."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astraflow.analysis.sinks import open_sinks, record_eval
from tests.conftest import REPO, make_run, require

FIELDS = ("step", "time", "reward_mean", "lr")
COMPLETION = "reward 1.000\n\n    7+5=\n\ncompletion:\n\n    12 <eos>"
EVAL = {"eval": {"policy": {"metric": "accuracy", "base": 0.25, "last": 0.75, "version": 3}}}


def trainer_like(run) -> None:
    """Steps 1-2 with a best completion at step 2, then a restarted trainer that replays step 2
    and goes on to step 3, then the evaluation."""
    for steps in ((1, 2), (2, 3)):
        sinks = open_sinks(run.path, "policy", FIELDS, run.config)
        for step in steps:
            sinks.scalars({"step": step, "time": 1e9 + step, "reward_mean": 0.25 * step, "lr": 1e-3}, step, 1e9 + step)
            if step == 2:
                sinks.text("best_completion", COMPLETION, step)
        sinks.close()
    record_eval(run.path, EVAL, run.config)


def wandb_records(directory: Path) -> list[dict]:
    """Every record of an offline W&B run, read by W&B's own reader of its transaction log."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(directory)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines()]


def test_wandb_offline_holds_every_row_text_and_eval_at_its_step(tmp_path):
    require("wandb")
    run = make_run(tmp_path, ["metrics.wandb.enabled=true", "metrics.wandb.project=tests"])
    trainer_like(run)
    runs = sorted((run.path / "metrics" / "wandb").glob("offline-run-*"))
    assert len(runs) == 3  # the trainer, the restarted trainer, the evaluation: one W&B run resumed
    history: list[tuple[Path, dict]] = []
    run_ids = set()
    for directory in runs:
        records = wandb_records(directory)
        run_ids |= {r["run"]["run_id"] for r in records if r["type"] == "run"}
        history += [(directory, r["history"]["item"]) for r in records if r["type"] == "history"]
    assert run_ids == {(run.path / "metrics" / "wandb-policy.id").read_text().strip()}
    rewards = [(item["step"], item["reward_mean"]) for _, item in history if "reward_mean" in item]
    assert rewards == [(1, 0.25), (2, 0.5), (2, 0.5), (3, 0.75)]  # the replayed step kept, at its step
    assert all("time" not in item for _, item in history)
    evals = [(item["step"], item["eval_accuracy"]) for _, item in history if "eval_accuracy" in item]
    assert evals == [(0, 0.25), (3, 0.75)]
    texts = [(d, item) for d, item in history if "best_completion._type" in item]
    assert [item["step"] for _, item in texts] == [2, 2]  # once per trainer start that did step 2
    for directory, item in texts:
        assert item["best_completion._type"] == "html-file"
        page = (directory / "files" / item["best_completion.path"]).read_text()
        assert page == "<pre>reward 1.000\n\n    7+5=\n\ncompletion:\n\n    12 &lt;eos&gt;</pre>"


def test_mlflow_file_store_holds_every_row_text_and_eval_at_its_step(tmp_path):
    require("mlflow")
    from mlflow.tracking import MlflowClient

    run = make_run(tmp_path, ["metrics.mlflow.enabled=true"])
    trainer_like(run)
    store = run.path / "metrics" / "mlflow"
    client = MlflowClient(store.as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "test"]  # run.name
    (found,) = client.search_runs([experiment.experiment_id])
    run_id = (run.path / "metrics" / "mlflow-policy.id").read_text().strip()
    assert found.info.run_id == run_id and found.info.run_name == "run/policy"
    assert found.data.tags["astraflow.policy"] == "policy" and found.info.status == "FINISHED"
    history = sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, "reward_mean"))
    assert history == [(1, 0.25, (1e9 + 1) * 1000), (2, 0.5, (1e9 + 2) * 1000), (2, 0.5, (1e9 + 2) * 1000),
                       (3, 0.75, (1e9 + 3) * 1000)]
    assert [m.step for m in client.get_metric_history(run_id, "lr")] == [1, 2, 2, 3]
    assert client.get_metric_history(run_id, "step") == [] and client.get_metric_history(run_id, "time") == []
    assert sorted((m.step, m.value) for m in client.get_metric_history(run_id, "eval_accuracy")) == [(0, 0.25),
                                                                                                   (3, 0.75)]
    text = Path(client.download_artifacts(run_id, "best_completion/step_000002.md", str(tmp_path)))
    assert text.read_text() == COMPLETION
    config = Path(client.download_artifacts(run_id, "config.yaml", str(tmp_path / "c")))
    assert "name: test" in config.read_text()


HIDE = "import sys; sys.modules[sys.argv[1]] = None; from astraflow.cli.main import main; sys.exit(main(sys.argv[2:]))"


@pytest.mark.parametrize("key, module, package", [("metrics.wandb.enabled", "wandb", "wandb"),
                                                  ("metrics.mlflow.enabled", "mlflow", "mlflow-skinny")])
def test_an_enabled_backend_that_is_not_installed_refuses_the_run_before_it_starts(tmp_path, key, module, package):
    """A process where `module` cannot be imported (`sys.modules[module] = None` is how
    Python marks a module as unimportable)."""
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", HIDE, module, "run", "configs/quickstart.yaml", "--run-dir",
                           str(run_dir), "--set", f"{key}=true"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == (f"astraflow run: error: {key}: true, but {module} is not installed here: pip install "
                           f"{package} (or the 'astraflow[tracking]' extra), or set {key}=false\n")
    assert not run_dir.exists()  # refused before the run directory was made


KILLED = """import sys, time
from astraflow.analysis.sinks import open_sinks
from astraflow.config.rundir import RunDir
run = RunDir.open(sys.argv[1])
sinks = open_sinks(run.path, "policy", ("step", "time", "reward_mean"), run.config)
for step in (1, 2, 3):
    sinks.scalars({"step": step, "time": 1e9 + step, "reward_mean": step / 4}, step, 1e9 + step)
print("logged", flush=True)
time.sleep(600)
"""


def test_wandb_rows_survive_a_killed_trainer(tmp_path):
    """W&B writes its log to disk every `FLUSH_S` (its own default, 15 s, lost the rows of a
    trainer killed within 15 s of logging them)."""
    require("wandb")
    from astraflow.analysis.sink_wandb import FLUSH_S

    run = make_run(tmp_path, ["metrics.wandb.enabled=true"])
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(run.path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout.readline() == "logged\n"
        time.sleep(FLUSH_S + 2.0)
    finally:
        proc.kill()
        proc.wait()
    (directory,) = (run.path / "metrics" / "wandb").glob("offline-run-*")
    rows = [r["history"]["item"] for r in wandb_records(directory) if r["type"] == "history"]
    assert [(r["step"], r["reward_mean"]) for r in rows] == [(1, 0.25), (2, 0.5), (3, 0.75)]
