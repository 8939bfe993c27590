"""Tiny real models built from config, with a tokenizer trained locally: no downloads."""
from __future__ import annotations

from pathlib import Path


def base_model_dir(run_dir: str | Path, configured: str) -> Path:
    """The run's starting weights: the configured model, or the one built into RUN_DIR/model."""
    return Path(configured) if configured else Path(run_dir) / "model"
