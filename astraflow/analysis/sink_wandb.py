"""Weights & Biases as a metrics sink (`analysis/sinks.py`), when `metrics.wandb.enabled`.

One W&B run per policy, named `<run dir>/<policy>` and grouped by the run directory's name,
its config the run's config. Rows are logged as they are written, texts (a step's best
completion) as `wandb.Html` at their step.

Invariants:
- `wandb` is imported here only, and this module only when the backend is enabled;
- the W&B run id is kept in `RUN_DIR/metrics/wandb-<policy>.id` (`stored_id`): a restarted
  trainer and the evaluation resume the run the first trainer start created;
- W&B's own step counter must only grow within a run, and a restarted trainer replays steps,
  so every value is logged against the metric `step` (`define_metric("*", step_metric=...)`)
  and W&B's counter only counts calls: a replayed step is a second point at its step, never
  a value W&B drops;
- what was logged is on disk within `FLUSH_S`, also when the trainer is killed;
- `mode: offline` writes under `RUN_DIR/metrics/wandb/` and needs no network and no account
  (`wandb sync RUN_DIR/metrics/wandb/offline-run-*` uploads it later; `wandb leet inspect
  --json` reads it).
"""
from __future__ import annotations

import dataclasses
import html
import secrets
from pathlib import Path

from astraflow.analysis.sinks import stored_id
from astraflow.config.schema import Config

STEP = "step"
# W&B writes its transaction log to disk this often (its default: 15 s); what it has not
# written when the trainer is killed is lost (a row logged 3 s before a SIGKILL was missing
# from the offline run with the default, present with 1 s)
FLUSH_S = 1.0
SKIP = ("step", "time")  # the step is logged as `step`; W&B stamps each call with its own time


class WandbSink:
    def __init__(self, run_dir: Path, policy: str, config: Config) -> None:
        import wandb

        self.wandb = wandb
        c = config.metrics.wandb
        run_id = stored_id(run_dir, "wandb", policy, lambda: secrets.token_hex(8))
        # console off: the trainer's log is its own file; W&B would copy every line of it
        self.run = wandb.init(project=c.project or config.run.name, entity=c.entity or None, mode=c.mode,
                              dir=str(run_dir / "metrics"), id=run_id, resume="allow",
                              name=f"{run_dir.name}/{policy}", group=run_dir.name,
                              settings=wandb.Settings(console="off", x_transaction_log_flush_interval=FLUSH_S))
        # a resumed run's config may differ in runtime keys: the latest is what it runs with
        self.run.config.update({**dataclasses.asdict(config), "run_dir": str(run_dir.resolve())},
                               allow_val_change=True)
        self.run.define_metric(STEP)
        self.run.define_metric("*", step_metric=STEP)

    def scalars(self, row: dict[str, float], step: int, walltime: float) -> None:
        self.run.log({**{k: v for k, v in row.items() if k not in SKIP}, STEP: step})

    def text(self, tag: str, text: str, step: int) -> None:
        # inject=False: W&B would otherwise add a stylesheet fetched from its servers
        page = self.wandb.Html(f"<pre>{html.escape(text)}</pre>", inject=False, data_is_not_path=True)
        self.run.log({tag: page, STEP: step})

    def close(self) -> None:
        self.run.finish()
