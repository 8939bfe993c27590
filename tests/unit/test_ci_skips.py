"""Under CI=true nothing skips but a GPU-only test (`tests/ci_skips.py`): a real pytest run, in
a child process, of tests that skip in each way the suite does."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.ci_skips import has_gpu
from tests.conftest import REPO

SKIPPING = '''
import pytest

def test_skips_inside():
    pytest.skip("no local Slurm cluster")

@pytest.mark.skipif(True, reason="namespaces need root")
def test_skipif():
    pass

def test_importorskip():
    pytest.importorskip("no_such_module_here")

@pytest.mark.gpu
def test_gpu_only():
    pass

@pytest.mark.xfail(reason="known", strict=True)
def test_expected_failure():
    assert False

def test_passes():
    pass
'''
SKIPPED_MODULE = '''
import pytest

pytest.skip("mounting a tmpfs needs root", allow_module_level=True)

def test_never_collected():
    pass
'''


def outcomes(tmp_path: Path, source: str, ci: bool) -> tuple[dict[str, int], str]:
    test = tmp_path / "test_it.py"
    test.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CI": "true" if ci else "false"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.ci_skips", "-rs", "-q", "-p", "no:cacheprovider",
                          "--rootdir", str(tmp_path), str(test)],
                         capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    summary = out.stdout.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", summary)}, out.stdout


def test_under_ci_every_skip_fails_but_a_gpu_tests(tmp_path: Path) -> None:
    counts, out = outcomes(tmp_path, SKIPPING, ci=True)
    gpu = {"passed": 2} if has_gpu() else {"passed": 1, "skipped": 1}
    assert counts == {"failed": 2, "error": 1, "xfailed": 1, **gpu}, out  # skipif: at setup, an error
    assert "skipped under CI=true" in out and "namespaces need root" in out and "no_such_module_here" in out
    # a module skipped whole: a collection error, with its reason
    counts, out = outcomes(tmp_path, SKIPPED_MODULE, ci=True)
    assert counts == {"error": 1} and "skipped under CI=true" in out and "mounting a tmpfs needs root" in out, out


def test_elsewhere_they_skip_saying_why(tmp_path: Path) -> None:
    counts, out = outcomes(tmp_path, SKIPPING, ci=False)
    assert counts == {"passed": 1 + has_gpu(), "skipped": 4 - has_gpu(), "xfailed": 1}, out
    assert "no local Slurm cluster" in out  # -rs lists the reasons
    counts, out = outcomes(tmp_path, SKIPPED_MODULE, ci=False)
    assert counts == {"skipped": 1} and "mounting a tmpfs needs root" in out, out
