"""The example configs and site profiles are package data: found by name or by their
repository path from any working directory, and shipped in the wheel, so a non-editable
install runs `astraflow run quickstart` and `astraflow-launch` (site.py looked for
`parents[2]/launchers`, which only a source checkout has)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from astraflow.config.loader import find_config, load_config
from astraflow.slurm.site import load_site
from tests.conftest import REPO


def test_configs_and_site_profiles_are_found_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert load_config("quickstart").run.name == load_config("configs/quickstart.yaml").run.name
    assert find_config("configs/multi_policy.yaml").is_file()
    assert load_site(None).dataflow_partition and load_site("example-cluster").account
    assert find_config("mine.yaml").name == "mine.yaml"  # not packaged: left for the reader to name


def test_a_wheel_carries_them_and_works_outside_the_source_tree(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "astraflow", src / "astraflow", ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("astraflow-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {"astraflow/configs/quickstart.yaml", "astraflow/launchers/local.yaml"} <= set(names)
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = ("import astraflow; from astraflow.slurm.site import load_site; "
             "from astraflow.config.loader import load_config; load_site(None); "
             "print(astraflow.__file__, load_config('quickstart').run.name)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(str(tmp_path / "site" / "astraflow"))
