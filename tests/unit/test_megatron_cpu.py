"""On a machine without a GPU, importing the megatron backend's model module points megatron's
CUDA-only calls at the CPU inside megatron's own modules, and nowhere else: torch itself (and
so every other library in the process) still has no CUDA device. Run in a fresh interpreter,
where nothing else has imported megatron."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

PROBE = """
import torch
import astraflow.trainer.megatron.model
from megatron.core import utils
from megatron.core.models.common.embeddings import rotary_pos_embedding
from megatron.core.tensor_parallel import random
assert utils.torch.cuda.current_device() == torch.device("cpu")
assert rotary_pos_embedding.torch.cuda.current_device() == torch.device("cpu")
state = torch.get_rng_state()
assert torch.equal(random._get_cuda_rng_state(), state)
try:
    torch.cuda.current_device()
except (AssertionError, RuntimeError):
    print("torch untouched")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the redirection is for machines without a GPU")
def test_megatron_sees_the_cpu_and_torch_is_untouched():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "torch untouched"

