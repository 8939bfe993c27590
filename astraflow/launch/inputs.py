"""Everything a run reads, checked before any component starts: the model directory, the
data set (every row), a search agent's corpus (every line), the reward, the model family's
shape, the sandbox where answers' tests run, the packages of the enabled metrics backends. A problem is one ConfigError naming the
file, line (or row) and field; `astraflow run` and the Slurm job's dataflow task exit with it
(code 2) within seconds, instead of starting components that would wait for a rank that never
publishes or crash-loop on a load. No torch here: JSON and data files only. The trainer's
parallel layout is checked against the model: tp must divide its attention and kv heads, pp
its layers, and the megatron backend must support its config.json.
"""
from __future__ import annotations

import json
from pathlib import Path

from astraflow.analysis.sinks import check_sink_packages
from astraflow.config.loader import ConfigError, load_config
from astraflow.config.rundir import RunDir
from astraflow.config.schema import Config
from astraflow.environments.retrieval import check_corpus
from astraflow.models.directory import ModelDirError, check_model_dir
from astraflow.models.families import FAMILIES
from astraflow.sandbox import Sandbox
from astraflow.tasks.sources import TaskSource
from astraflow.trainer.megatron.spec import MappingError, ModelSpec
from astraflow.workflows.rewards import load_reward


def has_chat_template(model_dir: Path) -> bool:
    config = model_dir / "tokenizer_config.json"
    declared = config.exists() and bool(json.loads(config.read_text()).get("chat_template"))
    return declared or (model_dir / "chat_template.jinja").exists()


def check_inputs(cfg: Config) -> None:
    m, t = cfg.model, cfg.tasks
    if m.path:
        try:
            info = check_model_dir(m.path)
        except ModelDirError as e:
            raise ConfigError(f"model.path: {e}") from None
        chat = has_chat_template(Path(m.path))
        shape = (info.heads, info.kv_heads, info.layers)
        if cfg.trainer.backend == "megatron":
            try:
                ModelSpec.of(json.loads((Path(m.path) / "config.json").read_text()))
            except MappingError as e:
                raise ConfigError(f"model.path: {m.path}: {e}") from None
    else:
        family = FAMILIES[m.like]
        if m.size not in family.shapes:
            raise ConfigError(f"model.size: {m.size!r} is not a size of model.like {m.like!r}; expected one of "
                              f"{list(family.shapes)}")
        chat = bool(family.chat_template)
        s = family.shapes[m.size]
        shape = (s.heads, s.kv_heads, s.layers)
    check_parallel_shape(cfg, *shape, m.path or f"model.like {m.like} at size {m.size}")
    if (t.chat_template or t.messages_key) and not chat:
        raise ConfigError(f"tasks.{'chat_template' if t.chat_template else 'messages_key'}: prompts go through a chat "
                          f"template, but the model ({m.path or 'model.like ' + m.like}) has none")
    if t.kind in ("jsonl", "parquet", "hf_disk") and not t.path:
        raise ConfigError(f"tasks.path: required when tasks.kind is {t.kind!r}")
    source = TaskSource(t)  # reads and validates every row
    load_reward(t.reward)
    if t.workflow == "code" or t.reward == "code_tests":
        why = Sandbox.check()  # else every answer would score 0, its tests never run
        if why:
            raise ConfigError(f"tasks.{'workflow' if t.workflow == 'code' else 'reward'}: the answers' tests run in "
                              f"the sandbox, which cannot run here: {why}")
    if t.workflow == "search":
        check_corpus(t)
        if cfg.warmup.steps > 0 and not any(i.row.get("queries") for i in source.warmup):
            raise ConfigError("warmup.steps: the search warm-up teaches each row's searches (its `queries` field), "
                              "and no warm-up row has one; set warmup.steps: 0, or use rows that have them "
                              "(tasks.kind: search_facts does)")
    check_sink_packages(cfg.metrics)


def check_parallel_shape(cfg: Config, heads: int, kv_heads: int, layers: int, model: str) -> None:
    """Tensor parallelism splits attention by heads and kv heads, pipeline parallelism the
    layers: each must divide."""
    t = cfg.trainer
    if heads % t.tp or kv_heads % t.tp:
        raise ConfigError(f"trainer.tp: {t.tp} does not divide the model's {heads} attention heads and {kv_heads} "
                          f"kv heads ({model})")
    if layers % t.pp:
        raise ConfigError(f"trainer.pp: {t.pp} does not divide the model's {layers} layers ({model})")


def open_run_checked(run_dir: str | Path, config: str | Path | None, overrides: list[str]) -> RunDir:
    """`RunDir.create_or_open` after `check_inputs`: a run directory is never created for
    inputs that cannot run."""
    exists = (Path(run_dir) / "config.yaml").exists()
    if not exists and config is not None:
        check_inputs(load_config(config, overrides))
    run = RunDir.create_or_open(run_dir, config, overrides)
    if exists:
        check_inputs(run.config)
    return run
