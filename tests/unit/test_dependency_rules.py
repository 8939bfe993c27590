"""The architecture's dependency rules, checked on the source (they keep components autonomous)."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "astraflow"
HEAVY = ("torch", "vllm", "transformers", "megatron")
# package -> the astraflow sub-packages it may import besides itself
ALLOWED = {"protocol": {"config"}, "config": set(), "store": {"config"}, "sandbox": set()}
NO_HEAVY = ("dataflow", "protocol", "config", "store", "analysis", "launch", "slurm", "sandbox", "environments",
            "workflows")


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_leaf_packages_import_only_what_they_may():
    for pkg, allowed in ALLOWED.items():
        for path in (PACKAGE / pkg).rglob("*.py"):
            for name in imports_of(path):
                parts = name.split(".")
                if parts[0] == "astraflow" and len(parts) > 1:
                    assert parts[1] in allowed | {pkg}, f"{path.relative_to(REPO)} imports {name}"


def test_light_components_never_import_heavy_libraries():
    for pkg in NO_HEAVY:
        for path in (PACKAGE / pkg).rglob("*.py"):
            heavy = {n for n in imports_of(path) if n.split(".")[0] in HEAVY}
            assert not heavy, f"{path.relative_to(REPO)} imports {heavy}"


def test_nothing_on_the_network_path_can_unpickle():
    for pkg in ("protocol", "dataflow"):
        for path in (PACKAGE / pkg).rglob("*.py"):
            assert not {"pickle", "cloudpickle", "dill"} & imports_of(path), path


def test_every_module_opens_with_a_docstring():
    for path in PACKAGE.rglob("*.py"):
        assert ast.get_docstring(ast.parse(path.read_text())), f"{path.relative_to(REPO)} has no docstring"


def test_dataflow_rank_starts_without_heavy_modules():
    code = ("import sys, astraflow.dataflow.server, astraflow.cli.main, astraflow.cli.launch, astraflow.slurm.node, "
            "astraflow.slurm.elastic, astraflow.environments.server, astraflow.sandbox; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"


def test_worker_and_evaluation_load_torch_only_with_their_engine():
    """OpenMP reads OMP_NUM_THREADS when torch loads, and `import_library` sets it first
    (`rollout/engines/__init__.py`): a module-level torch import on the way to the worker or
    the evaluation would run every engine batch with one thread per core."""
    code = ("import sys, astraflow.rollout.worker, astraflow.rollout.evaluate, astraflow.rollout.standby; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "[]"
