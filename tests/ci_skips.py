"""Under CI (`CI=true`) a skip is a failure: CI provides everything the suite needs (root, the
local Slurm cluster, vLLM, namespaces), so a test that skips there tests nothing while the
run looks green. The one exception is a test marked `@pytest.mark.gpu`, which skips on a
machine without a GPU (CI's machines have none) and fails nowhere for that reason.

A pytest plugin, loaded by tests/conftest.py (and by `-p tests.ci_skips`); tests skip with a
plain `pytest.skip` / `skipif` / `importorskip` saying why, and this turns the skip into a
failure that keeps the reason. A module skipped whole (`allow_module_level`) becomes a
collection error. Expected failures (`xfail`) are left alone.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def under_ci() -> bool:
    return os.environ.get("CI") == "true"


def has_gpu() -> bool:
    return NVIDIA_GPUS.is_dir() and any(NVIDIA_GPUS.iterdir())


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def _fail(report: pytest.CollectReport | pytest.TestReport) -> None:
    report.longrepr = f"skipped under CI=true, where nothing may skip but a @pytest.mark.gpu test: {_reason(report)}"
    report.outcome = "failed"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a GPU; skips without one (the only skip allowed under CI=true)")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not has_gpu():
        pytest.skip("needs a GPU (none in /proc/driver/nvidia/gpus)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    if (under_ci() and report.skipped and not hasattr(report, "wasxfail")
            and item.get_closest_marker("gpu") is None):
        _fail(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):
    outcome = yield
    report = outcome.get_result()
    if under_ci() and report.skipped:
        _fail(report)
