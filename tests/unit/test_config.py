"""Config validation, --set overrides, the strict YAML reader and the run directory."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
from typing import Iterator

import numpy as np
import pytest

from astraflow.config.loader import ConfigError, load_config, load_typed, parse_config
from astraflow.config.rundir import RunDir
from astraflow.config.schema import Config
from astraflow.slurm.site import SiteProfile
from tests.conftest import BASE_CONFIG, make_run


def test_base_config_loads_with_defaults():
    cfg = parse_config(BASE_CONFIG)
    assert cfg.policy_names == ("policy",)
    assert cfg.dataflow.lease_s == 30.0 and cfg.store.compression == "none"


def test_unknown_key_names_file_line_path_and_valid_keys(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE_CONFIG.replace("lease_s: 30", "lease_seconds: 30"))
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert f"{path}:3" in msg and "dataflow.lease_seconds: unknown key" in msg and "lease_s" in msg


def test_wrong_type_names_path_and_expected_type():
    with pytest.raises(ConfigError, match=r"dataflow\.lease_s: expected float, got str"):
        parse_config(BASE_CONFIG.replace("lease_s: 30", "lease_s: soon"))
    with pytest.raises(ConfigError, match=r"store\.locking: expected true or false, got int"):
        parse_config(BASE_CONFIG.replace("store: {shard_max_mb: 64}", "store: {locking: 1}"))


def test_missing_required_fields():
    with pytest.raises(ConfigError, match="policies: missing required field"):
        parse_config("run: {seed: 1}")
    with pytest.raises(ConfigError, match=r"policies\.0\.name: missing required field"):
        parse_config("policies: [{max_staleness: 1}]")


def test_choices_are_listed():
    with pytest.raises(ConfigError, match=r"store\.compression: 'zstd' is not one of \['none', 'lzf', 'gzip'\]"):
        parse_config(BASE_CONFIG, overrides=["store.compression=zstd"])
    with pytest.raises(ConfigError, match=r"trainer\.lr_schedule: 'step' is not one of \['constant', 'cosine'\]"):
        parse_config(BASE_CONFIG, overrides=["trainer.lr_schedule=step"])
    with pytest.raises(ConfigError, match=r"trainer: expected lr_warmup_steps >= 0 and 0 <= lr_min_ratio <= 1"):
        parse_config(BASE_CONFIG, overrides=["trainer.lr_min_ratio=2.0"])
    with pytest.raises(ConfigError, match=r"trainer.ref_kl: expected >= 0 \(0: no KL term\), got -0.1"):
        parse_config(BASE_CONFIG, overrides=["trainer.ref_kl=-0.1"])
    with pytest.raises(ConfigError, match=r"policies.0.ref_kl: expected >= 0 \(0: no KL term\), got -1.0"):
        parse_config(BASE_CONFIG, overrides=["policies.0.ref_kl=-1"])
    with pytest.raises(ConfigError, match=r"workflow.reference_guidance: only the rlvr, code, search and "
                                          r"solver_verifier workflows add reference answers; tasks.workflow is "
                                          r"'multi_turn_tool': set it to false"):
        parse_config(BASE_CONFIG, overrides=["workflow.reference_guidance=true", "tasks.workflow=multi_turn_tool",
                                                 "policies.0.role=agent"])
    with pytest.raises(ConfigError, match=r"workflow: expected max_turns >= 1, env_request_timeout_s > 0"):
        parse_config(BASE_CONFIG, overrides=["workflow.env_request_timeout_s=0"])
    with pytest.raises(ConfigError, match=r"workflow.verifier_contrast: only the solver_verifier workflow has "
                                          r"a verifier .*tasks.workflow is 'rlvr': set it to false"):
        parse_config(BASE_CONFIG, overrides=["workflow.verifier_contrast=true"])
    with pytest.raises(ConfigError, match=r"selection: expected 0 < explore <= 1 and max_streak >= 1, "
                                          r"got explore=0.0, max_streak=4"):
        parse_config(BASE_CONFIG, overrides=["selection.explore=0"])
    with pytest.raises(ConfigError, match=r"weights: expected full_every >= 1, bucket_mb > 0 and "
                                          r"broadcast_timeout_s > 0, got 0, 32.0, 30.0"):
        parse_config(BASE_CONFIG, overrides=["weights.full_every=0"])
    with pytest.raises(ConfigError, match=r"weights.channel.*'nccl'"):
        parse_config(BASE_CONFIG, overrides=["weights.channel=nccl"])
    with pytest.raises(ConfigError, match=r"weights\.relay: 'ring' is not one of \['chain', 'broadcast'\]"):
        parse_config(BASE_CONFIG, overrides=["weights.relay=ring"])
    with pytest.raises(ConfigError, match=r"rollout.weight_poll_s: expected > 0, got 0.0"):
        parse_config(BASE_CONFIG, overrides=["rollout.weight_poll_s=0"])
    with pytest.raises(ConfigError, match=r"rollout.partial: .*only the continuous engine.*engine.kind is 'hf'"):
        parse_config(BASE_CONFIG, overrides=["rollout.partial=true", "engine.kind=hf"])
    assert parse_config(BASE_CONFIG, overrides=["rollout.partial=true", "engine.kind=vllm"]).rollout.partial


def test_duplicate_policy_rejected():
    with pytest.raises(ConfigError, match="duplicate policy 'a'"):
        parse_config("policies: [{name: a}, {name: a}]")


def test_set_overrides_by_path_and_by_policy_name():
    cfg = parse_config(BASE_CONFIG, overrides=["dataflow.lease_s=5", "policies.policy.max_staleness=0"])
    assert cfg.dataflow.lease_s == 5.0 and cfg.policy("policy").max_staleness == 0
    with pytest.raises(ConfigError, match=r"--set.*dataflow\.nope: unknown key|dataflow\.nope: unknown key"):
        parse_config(BASE_CONFIG, overrides=["dataflow.nope=1"])
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_config(BASE_CONFIG, overrides=["dataflow.lease_s"])


def test_run_dir_layout_modes_and_manifest(tmp_path):
    run = make_run(tmp_path, ["run.seed=7"])
    assert stat.S_IMODE(run.path.stat().st_mode) == 0o700
    assert stat.S_IMODE(run.secret_path.stat().st_mode) == 0o600
    for sub in ("rendezvous", "shards", "journal", "weights", "checkpoints", "logs", "metrics"):
        assert (run.path / sub).is_dir()
    manifest = json.loads((run.path / "manifest.json").read_text())
    assert manifest["seeds"]["run"] == 7 and "git_sha" in manifest and manifest["packages"]["h5py"]
    assert load_config(run.path / "config.yaml").run.seed == 7  # resolved config, overrides applied
    with pytest.raises(ConfigError, match="a run already exists"):
        RunDir.create(run.path, tmp_path / "config.yaml")


def test_existing_run_accepts_only_runtime_changes(tmp_path):
    run = make_run(tmp_path)
    reopened = RunDir.open(run.path, ["dataflow.lease_s=9"])
    assert reopened.config.dataflow.lease_s == 9.0
    assert RunDir.open(run.path).config.dataflow.lease_s == 9.0  # persisted for every component
    with pytest.raises(ConfigError, match=r"store\.compression: fixed when the run directory was created"):
        RunDir.open(run.path, ["store.compression=lzf"])


def test_component_refuses_world_readable_secret(tmp_path):
    run = make_run(tmp_path)
    os.chmod(run.secret_path, 0o644)
    with pytest.raises(ConfigError, match="readable by others.*chmod 600"):
        RunDir.open(run.path)


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail (not hang) when the block runs longer: an alias bomb took minutes."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(path, tp=Config) -> str:
    """The loader's error for this file: a ConfigError of one line naming the file."""
    with within(5), pytest.raises(ConfigError) as e:
        load_typed(tp, path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{path}:"), msg
    return msg


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    levels = [f"l0: &l0 [{', '.join(['lol'] * 9)}]"] + \
        [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, 10)]  # 9**10 strings
    path = tmp_path / "bomb.yaml"
    path.write_text(BASE_CONFIG + "\n".join(levels) + "\n")
    assert path.stat().st_size < 1024
    assert "bomb.yaml:9: invalid YAML: alias *l0: anchors and aliases are not accepted" in refused(path)


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text(BASE_CONFIG + "dataflow: {lease_s: 5}\n")
    assert refused(path) == f"{path}:8: invalid YAML: duplicate key 'dataflow' (first given at line 3)"
    path.write_text("policies: [{name: a, max_staleness: 1, max_staleness: 2}]\n")  # in a flow mapping
    assert "duplicate key 'max_staleness' (first given at line 1)" in refused(path)


def test_binary_garbage_is_refused_in_one_line(tmp_path):
    path = tmp_path / "garbage.yaml"
    path.write_bytes(b"run: {seed: 1}\n" + np.random.default_rng(0).bytes(512))
    assert refused(path).startswith(f"{path}:2: not a YAML config: byte 0x")
    path.write_bytes(b"run: {seed: 1}\npolicies: \x00\x01\x02\n")  # UTF-8, but no text
    assert refused(path) == f"{path}:2: invalid YAML: character 0x0 at offset 25 is not allowed (binary data?)"
    path.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)))  # an executable given as the profile
    assert "not a YAML site profile" in refused(path, SiteProfile)


def test_unknown_tags_and_deep_nesting_are_refused(tmp_path):
    path = tmp_path / "tags.yaml"
    path.write_text(BASE_CONFIG + "tasks2: !!python/object/apply:os.system ['touch pwned']\n")
    assert "tags.yaml:8: invalid YAML: could not determine a constructor for the tag" in refused(path)
    path.write_text("account: !vault secret\n")  # a site profile, through the same loader
    assert "tags.yaml:1: invalid YAML: could not determine a constructor for the tag '!vault'" in \
        refused(path, SiteProfile)
    path.write_text("run: " + "[" * 2000 + "]" * 2000 + "\n")
    assert "tags.yaml:1: invalid YAML: nested more than 64 levels deep" in refused(path)
    path.write_text("run: {seed: [1\n")
    assert refused(path).startswith(f"{path}:2: invalid YAML: while parsing a flow sequence; expected ',' or ']'")
