"""Tiny real models built from config, with a tokenizer trained locally: no downloads.

Where a run's weights start: `base_model_dir` is the model as configured (`model.path`) or as
built into `RUN_DIR/model`; `policy_model_dir` is one policy's starting point, the base model
warmed up for that policy's role (`RUN_DIR/models/<policy>`), or the configured model itself
when there is no warm-up to do.
"""
from __future__ import annotations

from pathlib import Path

from astraflow.config.schema import Config


def base_model_dir(run_dir: str | Path, configured: str) -> Path:
    """The run's starting weights: the configured model, or the one built into RUN_DIR/model."""
    return Path(configured) if configured else Path(run_dir) / "model"


def policy_model_dir(run_dir: str | Path, cfg: Config, policy: str) -> Path:
    if cfg.model.path and cfg.warmup.steps <= 0:
        return Path(cfg.model.path)
    return Path(run_dir) / "models" / policy
