"""Tiny real models built from config, with a tokenizer trained locally: no downloads.

Where a run's weights start: `base_model_dir` is the model as configured (`model.path`) or as
built into `RUN_DIR/model`; `policy_model_dir` is one policy's starting point, the base model
warmed up for that policy's role (`RUN_DIR/models/<policy>`), or the configured model itself
when there is no warm-up to do.

Components may start while the launcher still prepares the model (`astraflow prepare` renames
each finished directory into place, so a `config.json` there means the directory is complete):
`wait_for_model` lets them import their libraries first and then wait for it.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path

from astraflow.config.schema import Config

log = logging.getLogger(__name__)

WAIT_LOG_S = 60.0  # how often a component still waiting for its model says so


def base_model_dir(run_dir: str | Path, configured: str) -> Path:
    """The run's starting weights: the configured model, or the one built into RUN_DIR/model."""
    return Path(configured) if configured else Path(run_dir) / "model"


def policy_model_dir(run_dir: str | Path, cfg: Config, policy: str) -> Path:
    if cfg.model.path and cfg.warmup.steps <= 0:
        return Path(cfg.model.path)
    return Path(run_dir) / "models" / policy


def wait_for_model(run_dir: str | Path, cfg: Config, policy: str, poll_s: float = 0.05) -> Path:
    """`policy_model_dir`, once the run's preparation has put it in place (a configured model
    used as it is is not prepared: it is returned at once, and a wrong path fails where it is loaded)."""
    path = policy_model_dir(run_dir, cfg, policy)
    if not path.is_relative_to(run_dir):
        return path
    next_log = time.monotonic()
    while not (path / "config.json").exists():
        if time.monotonic() >= next_log:
            log.info("waiting for the model of %s at %s (being prepared)", policy, path)
            next_log += WAIT_LOG_S
        time.sleep(poll_s)
    return path
