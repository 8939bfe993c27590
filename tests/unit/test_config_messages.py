"""Config errors name where the value came from (the file's line, or the `--set` that set
it) and suggest the closest valid name; a config file given with an existing run directory
must be that run's config, or it is refused naming the keys that differ."""
from __future__ import annotations

import pytest

from astraflow.cli.main import main
from astraflow.config.loader import ConfigError, load_config, parse_config
from astraflow.config.rundir import RunDir
from tests.conftest import BASE_CONFIG, make_run


def test_an_unknown_key_from_set_names_the_set_and_suggests_the_close_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE_CONFIG)
    with pytest.raises(ConfigError) as e:
        load_config(path, ["dataflow.lease_ss=5"])
    msg = str(e.value)
    assert msg.startswith("--set dataflow.lease_ss=5: dataflow.lease_ss: unknown key (did you mean 'lease_s'?)")
    assert str(path) not in msg  # the key is not in the file: no line of it is named
    with pytest.raises(ConfigError, match=r"^--set dataflow\.lease_s=soon: dataflow\.lease_s: expected float"):
        load_config(path, ["dataflow.lease_s=soon"])
    with pytest.raises(ConfigError, match=r"^--set dataflw\.lease_s=5: dataflw: unknown key \(did you mean 'dataflow'"):
        load_config(path, ["dataflw.lease_s=5"])
    with pytest.raises(ConfigError, match=r"no item 'polcy' \(did you mean 'policy'\?\)"):
        load_config(path, ["policies.polcy.max_staleness=1"])


def test_an_unknown_key_in_the_file_names_its_line_and_suggests_the_close_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(BASE_CONFIG.replace("lease_s: 30", "lease_sec: 30"))
    with pytest.raises(ConfigError, match=rf"^{path}:3: dataflow\.lease_sec: unknown key \(did you mean 'lease_s'\?\)"):
        load_config(path, ["dataflow.max_message_mb=2"])  # an unrelated --set is not blamed
    with pytest.raises(ConfigError, match="unknown key; valid keys"):  # nothing close: no suggestion
        parse_config(BASE_CONFIG, overrides=["dataflow.zzzzzzzz=1"])


def test_a_different_config_with_an_existing_run_is_refused_naming_the_keys(tmp_path):
    run = make_run(tmp_path)
    changed = tmp_path / "changed.yaml"
    changed.write_text(BASE_CONFIG.replace("lease_s: 30", "lease_s: 12"))
    with pytest.raises(ConfigError) as e:
        RunDir.create_or_open(run.path, changed)
    msg = str(e.value)
    assert msg.startswith(f"{changed}: differs from the config of the existing run {run.path} in dataflow.lease_s "
                          "(run: 30.0, file: 12.0)")
    assert f"--run-dir {run.path}" in msg
    assert RunDir.open(run.path).config.dataflow.lease_s == 30.0  # nothing was recorded


def test_the_same_config_resumes_and_set_still_changes_runtime_keys(tmp_path):
    run = make_run(tmp_path)
    same = tmp_path / "config.yaml"
    assert RunDir.create_or_open(run.path, same).config == run.config
    assert RunDir.create_or_open(run.path, same, ["dataflow.lease_s=9"]).config.dataflow.lease_s == 9.0
    # the run's config now has lease_s 9 (a runtime change): the file with the same --set still matches it
    assert RunDir.create_or_open(run.path, same, ["dataflow.lease_s=9"]).config.dataflow.lease_s == 9.0


def test_the_cli_labels_errors_by_command_not_as_config_errors(tmp_path, capsys):
    assert main(["dataflow", "--run-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err == f"astraflow dataflow: error: {tmp_path / 'none'}: no run here yet; give a config file to create one\n"
