"""`bench learn`: medians and checks over seeds; runs kept with `keep`, removed without.

`run_local` is replaced by a stand-in that writes a run directory and returns a summary, so
that what is tested is the bench's own bookkeeping (a real run per seed is a benchmark)."""
from pathlib import Path

import pytest

from astraflow.bench import learn

SUMMARIES = {0: (0.1, 0.7, 0.2, 0.6), 1: (0.2, 0.5, 0.2, 0.3), 2: (0.1, 0.65, 0.25, 0.7)}


@pytest.fixture
def made(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    dirs: list[Path] = []

    def run_local(config: str, run_dir: str, overrides: list[str], quiet: bool) -> dict:
        seed = int(overrides[-1].removeprefix("run.seed="))
        path = Path(run_dir)
        (path / "metrics").mkdir(parents=True)
        (path / "metrics" / "policy.csv").write_text("step,reward_mean\n1,0.1\n")
        dirs.append(path)
        first, last, base, end = SUMMARIES[seed]
        return {"reward_first": first, "reward_last": last, "eval_accuracy_base": base, "eval_accuracy": end,
                "wall_s": 300.0 + seed}

    monkeypatch.setattr(learn, "run_local", run_local)
    return dirs


def test_medians_and_checks_over_seeds(made: list[Path], tmp_path: Path) -> None:
    out = learn.run_bench("c.yaml", [0, 1, 2], [], run_dir=str(tmp_path))
    assert out["medians"]["reward_last"] == 0.65 and out["medians"]["heldout_gain"] == pytest.approx(0.4)
    assert out["checks"] == {"reward_first": True, "reward_last": True, "heldout_gain": True, "wall_s": True}
    assert out["passed"] and out["kept_in"] is None
    assert made and not any(d.exists() for d in made)  # the temporary runs are gone


def test_keep_holds_every_seed_run(made: list[Path], tmp_path: Path) -> None:
    keep = tmp_path / "kept"
    out = learn.run_bench("c.yaml", [0, 1], ["trainer.steps=5"], last_at_least=0.7, keep=str(keep))
    assert [d.name for d in made] == ["seed-0", "seed-1"] and all(d.parent == keep for d in made)
    assert (keep / "seed-1" / "metrics" / "policy.csv").exists()
    assert out["kept_in"] == str(keep) and not out["checks"]["reward_last"]  # median 0.6 < 0.7
