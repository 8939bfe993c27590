"""YAML -> typed `Config`, strictly.

Rejected before anything starts, each with the file, the line, the dotted key path and what
was expected: unknown keys (the valid ones are listed), wrong types, missing fields, values
outside a field's `choices`. `--set a.b=c` overrides are applied to the parsed YAML before
validation, so they are checked exactly like the file; a list of named items (policies) can
be addressed by index or by name: `policies.solver.max_staleness=1`.

The YAML itself is read strictly too (`strict_yaml.py`): a file that is not UTF-8, a syntax
error, an unknown tag, an alias, a duplicate key or too deep a nesting is one line naming the
file and line, never a traceback and never minutes spent expanding aliases.
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Iterable, TypeVar

import yaml

from astraflow.config.schema import WORKFLOW_ROLES, Config
from astraflow.config.strict_yaml import compose_and_load

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration problem, already phrased for the user."""


PACKAGED_CONFIGS = Path(__file__).resolve().parents[1] / "configs"  # package data (the repository's configs/)


def find_config(path: str | Path) -> Path:
    """`path` if it exists; else the packaged config of that name (`quickstart`,
    `quickstart.yaml`, `configs/quickstart.yaml` from another directory or a non-editable
    install); else `path` (reading it then names it)."""
    path = Path(path)
    if path.exists():
        return path
    packaged = PACKAGED_CONFIGS / (path.name if path.suffix else f"{path.name}.yaml")
    return packaged if packaged.is_file() else path


def load_config(path: str | Path, overrides: Iterable[str] = ()) -> Config:
    return load_typed(Config, find_config(path), overrides)


def parse_config(text: str, source: str = "<config>", overrides: Iterable[str] = ()) -> Config:
    return parse_typed(Config, text, source, overrides)


def load_typed(tp: type[T], path: str | Path, overrides: Iterable[str] = ()) -> T:
    """A YAML file as the dataclass `tp` (a run config, a site profile), strictly."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read {_kind(tp)}: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise ConfigError(f"{path}:{line}: not a YAML {_kind(tp)}: byte 0x{raw[e.start]:02x} at offset "
                          f"{e.start} is not UTF-8 text") from None
    return parse_typed(tp, text, source=str(path), overrides=overrides)


def parse_typed(tp: type[T], text: str, source: str, overrides: Iterable[str] = ()) -> T:
    node, data = _parse_yaml(text, source)
    data = {} if node is None else data
    if not isinstance(data, dict):
        raise ConfigError(f"{source}:1: the top level must be a mapping of sections")
    lines: dict[str, int] = {}
    if node is not None:
        _record_lines(node, "", lines)
    where = _Where(source, lines)
    for item in overrides:
        where.overrides[_apply_override(data, item, lines)] = item
    obj = _build(tp, data, "", where)
    if isinstance(obj, Config):
        obj = _derive_world(obj, data)
        _check_semantics(obj, where)
    return obj


def _derive_world(cfg: Config, data: dict) -> Config:
    """`trainer.world` left unset: the ranks the layout needs, tp x pp x max(dp, 1) (1 with
    the defaults), so that `--set trainer.tp=2` alone starts a tensor-parallel pair."""
    t = cfg.trainer
    if "world" in (data.get("trainer") or {}) or min(t.tp, t.pp) < 1 or t.dp < 0:  # (those refused next)
        return cfg
    return dataclasses.replace(cfg, trainer=dataclasses.replace(t, world=t.tp * t.pp * max(t.dp, 1)))


def _parse_yaml(text: str, source: str) -> tuple[yaml.Node | None, Any]:
    """`compose_and_load`, its errors as one line naming the file and line."""
    try:
        return compose_and_load(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f"{source}:{mark.line + 1}" if mark else source
        what = "; ".join(x for x in (e.context, e.problem) if x)
        raise ConfigError(f"{where}: invalid YAML: {what}") from None
    except yaml.reader.ReaderError as e:  # a character YAML does not allow (binary data)
        line = text.count("\n", 0, e.position) + 1
        raise ConfigError(f"{source}:{line}: invalid YAML: character "
                          f"{e.character:#x} at offset {e.position} is not allowed (binary data?)") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: invalid YAML: {' '.join(str(e).split())}") from None


def _kind(tp: type) -> str:
    """`SiteProfile` -> "site profile", for messages."""
    return "config" if tp is Config else "".join(f" {c.lower()}" if c.isupper() else c for c in tp.__name__).strip()


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(_plain(dataclasses.asdict(cfg)), sort_keys=False)


@dataclasses.dataclass(frozen=True)
class Change:
    path: str  # dotted key path
    old: Any
    new: Any
    runtime: bool  # changeable on an existing run (the field's `runtime` metadata)
    count: bool = False  # the number of items of a list differs (old, new: the lengths)

    def fixed_error(self) -> str:
        if self.count:
            return f"{self.path}: the number of items is fixed once the run exists ({self.old}, not {self.new})"
        return (f"{self.path}: fixed when the run directory was created ({self.old!r}); it cannot be changed "
                f"to {self.new!r} on an existing run")


def differences(old: Config, new: Config) -> list[Change]:
    """Every leaf key whose value differs, in schema order."""
    out: list[Change] = []
    _diff(old, new, "", out)
    return out


def runtime_changes(old: Config, new: Config) -> list[str]:
    """Dotted paths whose values differ; raises if one is not changeable at run time."""
    changes = differences(old, new)
    fixed = [c for c in changes if not c.runtime]
    if fixed:
        raise ConfigError(fixed[0].fixed_error())
    return [c.path for c in changes]


# ---------------------------------------------------------------- internals


@dataclasses.dataclass
class _Where:
    source: str
    lines: dict[str, int]
    overrides: dict[str, str] = dataclasses.field(default_factory=dict)  # --set key -> the whole item

    def at(self, path: str) -> str:
        """Where `path` came from: the `--set` that set it (or a section it created), else the
        file's line of it or of the nearest enclosing key in the file."""
        for key, item in self.overrides.items():
            if path == key or path.startswith(key + ".") or (key.startswith(path + ".") and path not in self.lines):
                return f"--set {item}"
        probe = path
        while probe and probe not in self.lines:
            probe = probe.rpartition(".")[0]
        line = self.lines.get(probe)
        return f"{self.source}:{line}" if line else self.source


def _check_semantics(cfg: Config, where: _Where) -> None:
    if not cfg.policies:
        raise ConfigError(f"{where.at('policies')}: policies: at least one policy is required")
    seen: set[str] = set()
    for i, p in enumerate(cfg.policies):
        if p.name in seen:
            raise ConfigError(f"{where.at(f'policies.{i}')}: policies.{i}.name: duplicate policy {p.name!r}")
        seen.add(p.name)
        if p.ref_kl is not None and p.ref_kl < 0:
            raise ConfigError(f"{where.at(f'policies.{i}.ref_kl')}: policies.{i}.ref_kl: expected >= 0 "
                              f"(0: no KL term), got {p.ref_kl}")
    if len(cfg.policies) > 127:
        raise ConfigError(f"{where.at('policies')}: policies: at most 127 policies")
    _check_roles(cfg, where)
    _check_pools(cfg, where)
    if cfg.tasks.kind in ("jsonl", "parquet", "hf_disk") and not cfg.tasks.path:
        raise ConfigError(f"{where.at('tasks')}: tasks.path: required when tasks.kind is {cfg.tasks.kind!r}")
    e = cfg.elastic
    if not 0 <= e.min_workers <= e.max_workers or e.step < 1:
        raise ConfigError(f"{where.at('elastic')}: elastic: expected 0 <= min_workers <= max_workers and step >= 1")
    if not 0 <= e.shrink_below < e.grow_above <= 1:
        raise ConfigError(f"{where.at('elastic')}: elastic: expected 0 <= shrink_below < grow_above <= 1")
    if cfg.dataflow.max_trajectory_tokens < 1:
        raise ConfigError(f"{where.at('dataflow.max_trajectory_tokens')}: dataflow.max_trajectory_tokens: expected >= 1")
    if cfg.store.max_open_shards < 1:
        raise ConfigError(f"{where.at('store.max_open_shards')}: store.max_open_shards: expected >= 1, "
                          f"got {cfg.store.max_open_shards}")
    if cfg.tasks.group_size < 1:
        raise ConfigError(f"{where.at('tasks.group_size')}: tasks.group_size: expected >= 1")
    sel = cfg.selection
    if not 0.0 < sel.explore <= 1.0 or sel.max_streak < 1:
        raise ConfigError(f"{where.at('selection')}: selection: expected 0 < explore <= 1 and max_streak >= 1, "
                          f"got explore={sel.explore}, max_streak={sel.max_streak}")
    _check_trainer_shapes(cfg, where)
    w = cfg.weights
    if w.full_every < 1 or w.bucket_mb <= 0 or w.broadcast_timeout_s <= 0:
        raise ConfigError(f"{where.at('weights')}: weights: expected full_every >= 1, bucket_mb > 0 and "
                          f"broadcast_timeout_s > 0, got {w.full_every}, {w.bucket_mb}, {w.broadcast_timeout_s}")
    if cfg.rollout.weight_poll_s <= 0:
        raise ConfigError(f"{where.at('rollout.weight_poll_s')}: rollout.weight_poll_s: expected > 0, "
                          f"got {cfg.rollout.weight_poll_s}")
    if cfg.rollout.partial and cfg.engine.kind != "vllm":
        raise ConfigError(f"{where.at('rollout.partial')}: rollout.partial: partial rollouts pause and resume "
                          f"generations in flight, which only the continuous engine does (engine.kind: vllm); "
                          f"engine.kind is {cfg.engine.kind!r}")
    t = cfg.trainer
    if t.lr_warmup_steps < 0 or not 0.0 <= t.lr_min_ratio <= 1.0:
        raise ConfigError(f"{where.at('trainer')}: trainer: expected lr_warmup_steps >= 0 and 0 <= lr_min_ratio <= 1")
    if t.ref_kl < 0:
        raise ConfigError(f"{where.at('trainer.ref_kl')}: trainer.ref_kl: expected >= 0 (0: no KL term), got {t.ref_kl}")
    if cfg.workflow.reference_guidance and cfg.tasks.workflow not in ("rlvr", "code", "search", "solver_verifier"):
        raise ConfigError(f"{where.at('workflow.reference_guidance')}: workflow.reference_guidance: only the "
                          f"rlvr, code, search and solver_verifier workflows add reference answers; tasks.workflow is "
                          f"{cfg.tasks.workflow!r}: set it to false")
    wf = cfg.workflow
    if wf.search_top_k < 1:
        raise ConfigError(f"{where.at('workflow.search_top_k')}: workflow.search_top_k: expected >= 1, "
                          f"got {wf.search_top_k}")
    if cfg.tasks.workflow == "search" and not cfg.tasks.corpus and cfg.tasks.kind != "search_facts":
        raise ConfigError(f"{where.at('tasks.corpus')}: tasks.corpus: the search workflow needs documents to search: a "
                          f"JSONL file, or tasks.kind: search_facts (its generated corpus); tasks.kind is "
                          f"{cfg.tasks.kind!r}")
    if cfg.tasks.kind == "search_facts" and cfg.tasks.hops not in (1, 2):
        raise ConfigError(f"{where.at('tasks.hops')}: tasks.hops: expected 1 or 2, got {cfg.tasks.hops}")
    if (wf.max_turns < 1 or wf.env_request_timeout_s <= 0 or wf.env_retries < 0 or wf.env_retry_budget < 0
            or wf.env_episode_deadline_s < 0 or wf.env_connections < 1):
        raise ConfigError(f"{where.at('workflow')}: workflow: expected max_turns >= 1, env_request_timeout_s > 0, "
                          f"env_retries >= 0, env_retry_budget >= 0, env_episode_deadline_s >= 0 (0: none) and "
                          f"env_connections >= 1")
    if cfg.workflow.verifier_contrast and cfg.tasks.workflow != "solver_verifier":
        raise ConfigError(f"{where.at('workflow.verifier_contrast')}: workflow.verifier_contrast: only the "
                          f"solver_verifier workflow has a verifier that judges answers it is shown; "
                          f"tasks.workflow is {cfg.tasks.workflow!r}: set it to false")


def _check_trainer_shapes(cfg: Config, where: _Where) -> None:
    """A step's batch is dealt to the group's data-parallel ranks evenly (the tp x pp ranks
    of one model replica train on the same rows), and each one's share cut into `minibatches`:
    a batch that does not divide would leave ranks waiting on each other."""
    world = cfg.trainer.world
    if world < 1:
        raise ConfigError(f"{where.at('trainer.world')}: trainer.world: expected >= 1, got {world}")
    _check_parallel(cfg, where)
    data = world // (cfg.trainer.tp * cfg.trainer.pp)
    for p in cfg.policies:
        t = cfg.trainer_for(p.name)
        key = f"policies.{p.name}.batch_size" if p.batch_size is not None else "trainer.batch_size"
        if t.batch_size < 1 or t.batch_size % data:
            raise ConfigError(f"{where.at(key)}: {key}: {t.batch_size} samples do not divide across {data} "
                              f"data-parallel ranks (trainer.world / (tp x pp)); expected a multiple of {data}")
        if t.minibatches < 1 or t.batch_size // data < t.minibatches:
            raise ConfigError(f"{where.at(key)}: {key}: each data-parallel rank's {t.batch_size // data} samples "
                              f"cannot make minibatches={t.minibatches}; expected at least one sample per minibatch")
    if cfg.trainer.max_tokens_per_microbatch < 0 or cfg.trainer.logprob_chunk_tokens < 1:
        raise ConfigError(f"{where.at('trainer')}: trainer: expected max_tokens_per_microbatch >= 0 (0: no limit) "
                          f"and logprob_chunk_tokens >= 1")


def _check_parallel(cfg: Config, where: _Where) -> None:
    """trainer.world = tp x pp x dp, and the torch backend is data parallel only. (That tp
    divides the model's heads and pp its layers is checked with the model: launch/inputs.py.)"""
    t = cfg.trainer
    for key, value, least in (("tp", t.tp, 1), ("pp", t.pp, 1), ("dp", t.dp, 0)):
        if value < least:
            raise ConfigError(f"{where.at(f'trainer.{key}')}: trainer.{key}: expected >= {least}, got {value}")
    if t.backend == "torch" and t.distributed_optimizer:
        raise ConfigError(f"{where.at('trainer.distributed_optimizer')}: trainer.distributed_optimizer: true needs "
                          f"trainer.backend megatron (the torch backend keeps a whole optimizer on every rank); "
                          f"expected false")
    if t.sequence_parallel and (t.backend != "megatron" or t.tp < 2):
        raise ConfigError(f"{where.at('trainer.sequence_parallel')}: trainer.sequence_parallel: true splits the "
                          f"sequence over tensor-parallel ranks: it needs trainer.backend megatron and trainer.tp > 1 "
                          f"(backend {t.backend}, tp {t.tp})")
    if t.backend == "torch" and (t.tp, t.pp) != (1, 1):
        key = "tp" if t.tp != 1 else "pp"
        raise ConfigError(f"{where.at(f'trainer.{key}')}: trainer.{key}: {getattr(t, key)}, but the torch backend is "
                          f"data parallel only (tp = pp = 1); tensor and pipeline parallelism need "
                          f"trainer.backend: megatron")
    if t.world % (t.tp * t.pp):
        raise ConfigError(f"{where.at('trainer.world')}: trainer.world: {t.world} ranks do not make whole model "
                          f"replicas of tp x pp = {t.tp} x {t.pp} = {t.tp * t.pp} ranks")
    if t.dp and t.tp * t.pp * t.dp != t.world:
        raise ConfigError(f"{where.at('trainer.dp')}: trainer.dp: tp x pp x dp = {t.tp} x {t.pp} x {t.dp} = "
                          f"{t.tp * t.pp * t.dp} ranks, but trainer.world is {t.world}")


def _check_roles(cfg: Config, where: _Where) -> None:
    needed = WORKFLOW_ROLES[cfg.tasks.workflow]
    for i, p in enumerate(cfg.policies):
        if p.role not in needed:
            raise ConfigError(f"{where.at(f'policies.{i}.role')}: policies.{i}.role: {p.role!r} is not a role of "
                              f"workflow {cfg.tasks.workflow!r}; expected one of {list(needed)}")
    for role in needed:
        players = [p.name for p in cfg.policies if p.role == role]
        if len(players) != 1:
            raise ConfigError(f"{where.at('policies')}: policies: workflow {cfg.tasks.workflow!r} needs exactly one "
                              f"policy with role {role!r}, found {players or 'none'}")


def _check_pools(cfg: Config, where: _Where) -> None:
    pools = cfg.rollout.pools
    for i, pool in enumerate(pools):
        unknown = [p for p in pool.policies if p not in cfg.policy_names]
        if unknown or not pool.policies or pool.workers < 1:
            raise ConfigError(f"{where.at(f'rollout.pools.{i}')}: rollout.pools.{i}: expected workers >= 1 and "
                              f"policies among {list(cfg.policy_names)}, got workers={pool.workers}, "
                              f"policies={list(pool.policies)}")
    if pools and sum(p.workers for p in pools) != cfg.rollout.workers:
        raise ConfigError(f"{where.at('rollout.pools')}: rollout.pools: the pools' workers add up to "
                          f"{sum(p.workers for p in pools)}, rollout.workers is {cfg.rollout.workers}")
    if cfg.rollout.workers < 0:
        raise ConfigError(f"{where.at('rollout.workers')}: rollout.workers: expected >= 0, got {cfg.rollout.workers}")
    if cfg.rollout.workers == 0:
        if not cfg.rollout.standby:
            raise ConfigError(f"{where.at('rollout.workers')}: rollout.workers: 0 workers and no rollout.standby "
                              f"directory: nothing would generate; expected workers >= 1 or a standby directory")
        return
    if not any(set(cfg.task_policies) <= set(cfg.worker_policies(i)) for i in range(cfg.rollout.workers)):
        raise ConfigError(f"{where.at('rollout.pools')}: rollout.pools: no worker hosts every policy an episode "
                          f"needs ({list(cfg.task_policies)}), so no task could ever be handed out")


def _record_lines(node: yaml.Node, prefix: str, out: dict[str, int]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            path = f"{prefix}.{key.value}" if prefix else str(key.value)
            out[path] = key.start_mark.line + 1
            _record_lines(value, path, out)
    elif isinstance(node, yaml.SequenceNode):
        for i, value in enumerate(node.value):
            path = f"{prefix}.{i}"
            out[path] = value.start_mark.line + 1
            _record_lines(value, path, out)


def _apply_override(data: dict, item: str, lines: dict[str, int]) -> str:
    """Set `KEY.PATH=VALUE` in the parsed YAML; returns the key path."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise ConfigError(f"--set {item!r}: expected KEY.PATH=VALUE")
    try:
        value = compose_and_load(raw)[1]
    except yaml.YAMLError:
        value = raw
    parts = key.split(".")
    target: Any = data
    for i, part in enumerate(parts[:-1]):
        target = _step(target, part, ".".join(parts[: i + 1]), create=True)
    last = parts[-1]
    if isinstance(target, list):
        raise ConfigError(f"--set {key}: cannot replace a list item wholesale")
    target[last] = value
    lines.pop(key, None)
    return key


def _step(target: Any, part: str, path: str, create: bool) -> Any:
    if isinstance(target, list):
        if part.isdigit() and int(part) < len(target):
            return target[int(part)]
        named = [x for x in target if isinstance(x, dict) and x.get("name") == part]
        if named:
            return named[0]
        names = [x.get("name") for x in target if isinstance(x, dict)]
        raise ConfigError(f"--set {path}: no item {part!r}{did_you_mean(part, map(str, names))}; items: {names}")
    if isinstance(target, dict):
        if part not in target and create:
            target[part] = {}
        return target[part]
    raise ConfigError(f"--set {path}: not a section")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _build(tp: Any, value: Any, path: str, where: _Where) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path, where)
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{where.at(path)}: {path}: expected a list, got {_show(value)}")
        return tuple(_build(item_tp, v, f"{path}.{i}", where) for i, v in enumerate(value))
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        tp = next(o for o in options if o is not type(None))
        return _build(tp, value, path, where)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is bool and not isinstance(value, bool):
        raise ConfigError(f"{where.at(path)}: {path}: expected true or false, got {_show(value)}")
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{where.at(path)}: {path}: expected int, got {_show(value)}")
    if not isinstance(value, tp):
        raise ConfigError(f"{where.at(path)}: {path}: expected {_type_name(tp)}, got {_show(value)}")
    return value


def _build_dataclass(tp: Any, value: Any, path: str, where: _Where) -> Any:
    label = path or "top level"
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where.at(path)}: {label}: expected a mapping, got {_show(value)}")
    fields = {f.name: f for f in dataclasses.fields(tp)}
    hints = typing.get_type_hints(tp)
    for key in value:
        if key not in fields:
            sub = f"{path}.{key}" if path else str(key)
            raise ConfigError(f"{where.at(sub)}: {sub}: unknown key{did_you_mean(str(key), fields)}; "
                              f"valid keys of {label}: {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name not in value:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where.at(path)}: {sub}: missing required field ({_type_name(hints[name])})")
            continue
        built = _build(hints[name], value[name], sub, where)
        choices = f.metadata.get("choices")
        if choices and built not in choices:
            raise ConfigError(f"{where.at(sub)}: {sub}: {built!r} is not one of {list(choices)}")
        kwargs[name] = built
    return tp(**kwargs)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """" (did you mean 'steps'?)" for the closest valid names (difflib), or ""."""
    close = difflib.get_close_matches(word, list(choices), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}"


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _diff(old: Any, new: Any, path: str, out: list[Change]) -> None:
    if dataclasses.is_dataclass(old):
        for f in dataclasses.fields(old):
            sub = f"{path}.{f.name}" if path else f.name
            a, b = getattr(old, f.name), getattr(new, f.name)
            if a == b:
                continue
            if dataclasses.is_dataclass(a) or isinstance(a, tuple):
                _diff(a, b, sub, out)
            else:
                out.append(Change(sub, a, b, bool(f.metadata.get("runtime"))))
    elif isinstance(old, tuple):
        if len(old) != len(new):
            out.append(Change(path, len(old), len(new), False, count=True))
            return
        for i, (a, b) in enumerate(zip(old, new)):
            _diff(a, b, f"{path}.{i}", out)
