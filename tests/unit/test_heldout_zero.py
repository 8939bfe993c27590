"""`tasks.heldout: 0` (a data set with no test prompts apart from its training prompts): the
evaluation is skipped with a reason, and the plot and the end-of-run summary say so instead
of failing on the missing accuracies."""
from __future__ import annotations

import json

from astraflow.analysis.plot import plot_run
from astraflow.config.rundir import RunDir
from astraflow.launch.summary import format_summary
from astraflow.rollout.evaluate import evaluate_run
from tests.conftest import trained_run_dir


def test_no_heldout_prompts_skip_the_evaluation_and_the_plot_still_draws(tmp_path):
    run_dir = trained_run_dir(tmp_path)
    cfg_text = (run_dir / "config.yaml").read_text()
    (run_dir / "config.yaml").write_text(cfg_text.replace("heldout: 200", "heldout: 0"))  # as if created so
    out = evaluate_run(RunDir.open(run_dir))
    assert out == {"eval": {}, "eval_skipped": "tasks.heldout is 0: no held-out prompts to evaluate on"}
    (run_dir / "eval.json").write_text(json.dumps(out))
    assert plot_run(run_dir).read_bytes()[:4] == b"\x89PNG"
    summary = {"run_dir": str(run_dir), "wall_s": 1.0, "components_s": 1.0, **out, "trajectories": 32,
               "trained": 32, "samples_per_s": 32.0, "dropped": 0, "dropped_stale": 0, "filtered_zero_advantage": 0,
               "unused_trainer_done": 0, "target_reward": 0.8, "policies": {"policy": {"steps": 0}}}
    assert "held-out accuracy: tasks.heldout is 0: no held-out prompts" in format_summary(summary)
