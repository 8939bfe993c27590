"""Where a trainer's per-step metrics go: one `MetricsSink` interface, one class per backend.

- `CsvSink`: `RUN_DIR/metrics/<policy>.csv`, always on: the progress line, the summary, the
  plot and the report read it (`analysis/metrics.py` owns its format);
- `TensorBoardSink`: event files in `RUN_DIR/metrics/tensorboard/<policy>/`, scalars
  `<policy>/<column>` at the step, and texts: the best-rewarded completion of a step every
  `trainer.checkpoint_every` steps (`best_completion`), and the held-out accuracy of the
  starting and last weights once the evaluation is done (`record_eval`);
- `WandbSink` (`sink_wandb.py`) and `MlflowSink` (`sink_mlflow.py`), when `metrics.wandb` /
  `metrics.mlflow` are enabled: one W&B / MLflow run per policy, the same rows and texts.
  Their packages are optional: `check_sink_packages` refuses a run whose enabled backend is
  not installed before anything starts (`launch/inputs.py`), and the trainer opens its sinks
  when it starts, so a backend that cannot open (no credentials, no server) stops the
  trainer at its start with its own error, never mid-run.

Sinks see rows as written, replayed steps included (a restarted trainer writes a step's row
again: a CSV reader merges them, a TensorBoard chart shows the step's last value, W&B and
MLflow keep both points at the step).
"""
from __future__ import annotations

import os
import time
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np

from astraflow.analysis.metrics import append_metrics, metrics_path
from astraflow.config.loader import ConfigError
from astraflow.config.schema import Config, MetricsConfig

if TYPE_CHECKING:
    from astraflow.protocol.messages import TrajectoryBatch

TENSORBOARD_DIR = ("metrics", "tensorboard")


class MetricsSink(Protocol):
    def scalars(self, row: dict[str, float], step: int, walltime: float) -> None: ...

    def text(self, tag: str, text: str, step: int) -> None: ...

    def close(self) -> None: ...


class CsvSink:
    def __init__(self, run_dir: Path, policy: str, fields: tuple[str, ...]) -> None:
        self.path, self.fields = metrics_path(run_dir, policy), fields

    def scalars(self, row: dict[str, float], step: int, walltime: float) -> None:
        append_metrics(self.path, self.fields, row)

    def text(self, tag: str, text: str, step: int) -> None:
        """A CSV holds numbers only."""

    def close(self) -> None:
        """Every row is written and closed at once."""


class TensorBoardSink:
    def __init__(self, run_dir: Path, name: str, skip: tuple[str, ...] = ("step", "time"), suffix: str = "") -> None:
        """`suffix` names the event file apart: two writers of one directory in the same second
        (the file name holds the time in seconds) would otherwise write one file over the other."""
        self.dir, self.name, self.skip, self.suffix = run_dir.joinpath(*TENSORBOARD_DIR, name), name, skip, suffix
        self.writer = None  # created at the first write: a trainer that never steps leaves no file

    def _open(self):  # noqa: ANN202 - tensorboardX's SummaryWriter, imported here only
        if self.writer is None:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(str(self.dir), filename_suffix=self.suffix)
        return self.writer

    def scalars(self, row: dict[str, float], step: int, walltime: float) -> None:
        writer = self._open()
        for key, value in row.items():
            if key not in self.skip:
                writer.add_scalar(f"{self.name}/{key}", value, step, walltime=walltime)
        writer.flush()

    def text(self, tag: str, text: str, step: int) -> None:
        self._open().add_text(f"{self.name}/{tag}", text, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class Sinks:
    """Every sink of one writer, written together."""

    def __init__(self, sinks: list[MetricsSink]) -> None:
        self.sinks = sinks

    def scalars(self, row: dict[str, float], step: int, walltime: float) -> None:
        for sink in self.sinks:
            sink.scalars(row, step, walltime)

    def text(self, tag: str, text: str, step: int) -> None:
        for sink in self.sinks:
            sink.text(tag, text, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


# the optional backends: section of `metrics` (and module), what to install
OPTIONAL = (("wandb", "wandb"), ("mlflow", "mlflow-skinny"))


def check_sink_packages(metrics: MetricsConfig) -> None:
    """A ConfigError naming the key and the `pip install` line for each enabled backend whose
    package is missing (found without importing it: this runs before every start)."""
    for module, package in OPTIONAL:
        key = f"metrics.{module}.enabled"
        if getattr(metrics, module).enabled and find_spec(module) is None:
            raise ConfigError(f"{key}: true, but {module} is not installed here: pip install {package} (or the "
                              f"'astraflow[tracking]' extra), or set {key}=false")


def backend_sinks(run_dir: Path, policy: str, config: Config) -> list[MetricsSink]:
    """The enabled optional backends' sinks of one policy, opened (their packages imported)."""
    check_sink_packages(config.metrics)
    sinks: list[MetricsSink] = []
    if config.metrics.wandb.enabled:
        from astraflow.analysis.sink_wandb import WandbSink

        sinks.append(WandbSink(run_dir, policy, config))
    if config.metrics.mlflow.enabled:
        from astraflow.analysis.sink_mlflow import MlflowSink

        sinks.append(MlflowSink(run_dir, policy, config))
    return sinks


def open_sinks(run_dir: Path, policy: str, fields: tuple[str, ...], config: Config) -> Sinks:
    """A trainer's sinks: its CSV, its TensorBoard run and the enabled optional backends."""
    return Sinks([CsvSink(run_dir, policy, fields), TensorBoardSink(run_dir, policy),
                  *backend_sinks(run_dir, policy, config)])


def stored_id(run_dir: Path, backend: str, policy: str, create: Callable[[], str]) -> str:
    """The id of `policy`'s run in `backend`, kept in RUN_DIR/metrics/<backend>-<policy>.id:
    the first trainer start `create`s the run, a restarted trainer and the evaluation log on
    to it. Written atomically: a trainer killed meanwhile leaves no half id."""
    path = run_dir / "metrics" / f"{backend}-{policy}.id"
    if path.exists():
        return path.read_text().strip()
    run_id = create()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)
    return run_id


def best_completion(batch: "TrajectoryBatch", decode: Callable[[list[int]], str]) -> str:
    """The batch's highest-rewarded trajectory as Markdown text (TensorBoard renders it): its
    reward, the prompt, then the completion (from the first token the policy generated)."""
    i = int(np.argmax(batch.reward))
    lo, hi = int(batch.offsets[i]), int(batch.offsets[i + 1])
    tokens, mask = batch.tokens[lo:hi].tolist(), batch.loss_mask[lo:hi].astype(bool)
    first = int(mask.argmax()) if mask.any() else len(tokens)
    return (f"reward {float(batch.reward[i]):.3f}\n\n    {decode(tokens[:first])}\n\n"
            f"completion:\n\n    {decode(tokens[first:])}")


def record_eval(run_dir: Path, evals: dict, config: Config) -> None:
    """The held-out scores of `eval.json` beside the training curves, in TensorBoard and the
    enabled backends: `eval_<metric>` at step 0 (the starting weights) and at the step of the
    last published version."""
    for policy, e in evals.get("eval", {}).items():
        sink = Sinks([TensorBoardSink(run_dir, policy, suffix=".eval"), *backend_sinks(run_dir, policy, config)])
        sink.scalars({f"eval_{e['metric']}": e["base"]}, 0, time.time())
        if "last" in e:
            sink.scalars({f"eval_{e['metric']}": e["last"]}, e["version"], time.time())
        sink.close()
