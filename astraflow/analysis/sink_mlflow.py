"""MLflow as a metrics sink (`analysis/sinks.py`), when `metrics.mlflow.enabled`.

One MLflow run per policy in the experiment `metrics.mlflow.experiment` (default: the run's
name), named `<run dir>/<policy>`, tagged with the run directory and the policy, the run's
config.yaml as its artifact. Each row is one `log_batch` of its columns at the step with the
row's time; a text (a step's best completion) is the artifact `<tag>/step_<step>.md`.

Invariants:
- `mlflow` is imported here only, and this module only when the backend is enabled; only
  `MlflowClient` is used (no process-wide active run), so `mlflow-skinny` is enough;
- the MLflow run id is kept in `RUN_DIR/metrics/mlflow-<policy>.id` (`stored_id`): a
  restarted trainer and the evaluation log on to the run the first trainer start created
  (MLflow keeps a replayed step's value as a second point at that step);
- the default tracking URI is `file:RUN_DIR/metrics/mlflow`: no server, no network. MLflow
  keeps that file store in maintenance mode and refuses it unless MLFLOW_ALLOW_FILE_STORE is
  set, which this sets for `file:` URIs (the store a run directory on a cluster filesystem
  needs, where a SQLite database would be shared over NFS);
- the experiment is looked up or created under a lock file in `RUN_DIR/metrics`: the
  trainers of a multi-policy run start together, and two creating it at once would make two
  experiments of one name.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from astraflow.analysis.sinks import stored_id
from astraflow.config.schema import Config

SKIP = ("step", "time")  # the step and the time are every metric's own fields in MLflow


def tracking_uri(run_dir: Path, config: Config) -> str:
    return config.metrics.mlflow.tracking_uri or (run_dir / "metrics" / "mlflow").resolve().as_uri()


class MlflowSink:
    def __init__(self, run_dir: Path, policy: str, config: Config) -> None:
        uri = tracking_uri(run_dir, config)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self.metric, self.client = Metric, MlflowClient(uri)
        name = config.metrics.mlflow.experiment or config.run.name
        with open(run_dir / "metrics" / "mlflow.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            found = self.client.get_experiment_by_name(name)
            experiment = found.experiment_id if found is not None else self.client.create_experiment(name)
        self.run_id = stored_id(run_dir, "mlflow", policy, lambda: self._create(run_dir, policy, experiment))
        self.client.update_run(self.run_id, status="RUNNING")  # a resumed run was marked finished

    def _create(self, run_dir: Path, policy: str, experiment: str) -> str:
        run = self.client.create_run(experiment, run_name=f"{run_dir.name}/{policy}",
                                     tags={"astraflow.run_dir": str(run_dir.resolve()), "astraflow.policy": policy})
        self.client.log_artifact(run.info.run_id, str(run_dir / "config.yaml"))
        return run.info.run_id

    def scalars(self, row: dict[str, float], step: int, walltime: float) -> None:
        ms = int(walltime * 1000)
        self.client.log_batch(self.run_id, metrics=[self.metric(k, float(v), ms, step)
                                                    for k, v in row.items() if k not in SKIP])

    def text(self, tag: str, text: str, step: int) -> None:
        self.client.log_text(self.run_id, text, f"{tag}/step_{step:06d}.md")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)
