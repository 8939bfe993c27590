"""The prepared GPU check (`tools/gpu_check.py`): its code runs here on the CPU with a tiny
shape, so the minutes on a GPU machine go to measuring, not debugging; on a machine with CUDA
the full check runs (0.5B- and 1.5B-shaped models at 4k tokens, bf16, both trainer backends)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def run_check(*args: str, timeout: int) -> dict:
    out = subprocess.run([sys.executable, "tools/gpu_check.py", *args], cwd=REPO, capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_the_gpu_check_runs_on_a_cpu_with_a_tiny_shape():
    report = run_check("--sizes", "tiny", "--seq", "64", "--rows", "4", "--micro-rows", "2", "--steps", "1",
                       "--gen-prompts", "4", "--gen-tokens", "8", "--cpu", timeout=300)
    tiny = report["results"]["tiny"]
    for backend in ("torch", "megatron"):
        train = tiny[f"train_{backend}"]
        assert train["tokens_per_s"] > 0 and train["parity"]["max_abs_diff"] < 1e-4, backend  # fp32 here
    assert tiny["generate"]["tokens_per_s"] > 0 and report["device"].startswith("cpu")


@pytest.mark.gpu
def test_the_gpu_check_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    report = run_check("--out", "gpu_check.json", timeout=900)
    for size, result in report["results"].items():
        for backend in ("torch", "megatron"):
            train = result[f"train_{backend}"]
            assert train["mfu"] is None or train["mfu"] > 0.03, (size, backend)  # megatron: 0.054 at 0.5b
            assert train["parity"]["max_abs_diff"] < 0.5, (size, backend)  # bf16 against fp32
