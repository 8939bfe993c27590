"""Storage failures: the run directory's filesystem fills up; a shard is truncated and a
weight file overwritten with garbage while the run is stopped. Real files on a real
size-limited tmpfs (root needed: without it they skip, and under CI=true fail, `tests/ci_skips.py`)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from astraflow.analysis.audit import lineage
from astraflow.store.reader import ShardCorrupt, ShardReader, iter_shards, load_rows
from tests.chaos.harness import check_ledgers_and_audit, finish, resume, start, wait_steps

pytestmark = pytest.mark.chaos

if os.geteuid() != 0:
    pytest.skip("mounting a size-limited tmpfs needs root", allow_module_level=True)


@pytest.fixture
def small_fs(tmp_path):
    mount = tmp_path / "fs"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], check=True)
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Take every free byte of the filesystem."""
    filler = directory / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
        except OSError:
            pass
    return filler


def test_full_filesystem_stops_the_run_cleanly_and_it_resumes_when_there_is_room(tmp_path, small_fs):
    run_dir = small_fs / "run"
    proc, _ = start(tmp_path, steps=14, extra=["launcher.max_restarts=2", "store.min_free_mb=4"], run_dir=run_dir)
    try:
        wait_steps(proc, run_dir, 3)
        filler = fill(small_fs)
        out, err = finish(proc, timeout_s=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0
    last = err.strip().splitlines()[-1]  # one line that names the component and the cause
    assert last.startswith("astraflow run:") and ("No space left on device" in last or "MB free" in last), last
    filler.unlink()
    for path in iter_shards(run_dir):  # nothing the full disk touched is corrupt
        ShardReader(path).close()
    assert not list((run_dir / "shards" / "quarantine").glob("*.h5"))
    print(last)
    proc = resume(run_dir)  # now that there is room
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    check_ledgers_and_audit(run_dir)


def test_truncated_shard_and_garbage_weights_are_detected_and_handled(tmp_path):
    proc, run_dir = start(tmp_path, steps=30, extra=["store.shard_max_mb=0.05"])
    try:
        wait_steps(proc, run_dir, 8)
        proc.send_signal(signal.SIGINT)  # stop; resume later from the run directory
        finish(proc, timeout_s=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    trained = {s for ev in lineage(run_dir).values() for s in ev["ids"]}
    for victim in reversed(list(iter_shards(run_dir))[:-1]):  # the newest closed shard with trained samples
        reader = ShardReader(victim)
        rows = reader.rows(("sample_id", "task_id"))
        reader.close()
        tasks = set(rows["task_id"].tolist())
        trained_tasks = {t for s, t in zip(rows["sample_id"].tolist(), rows["task_id"].tolist()) if s in trained}
        if trained_tasks:
            break
    assert trained_tasks, "no closed shard holds a trained sample: nothing to regenerate"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size // 2)
    weights = sorted((run_dir / "weights" / "policy").glob("v*"), key=lambda p: int(p.name[1:]))[-1]
    (weights / "model.safetensors").write_bytes(os.urandom(4096))

    proc = resume(run_dir)
    out, err = finish(proc)
    assert proc.returncode == 0, err[-3000:]
    with pytest.raises(ShardCorrupt):
        ShardReader(run_dir / "shards" / "quarantine" / victim.name)
    assert "quarantined shard" in (run_dir / "logs" / "dataflow.log").read_text()
    assert tasks <= set(load_rows(run_dir)["task_id"].tolist())  # every task of it committed again
    trainer_log = (run_dir / "logs" / "trainer-policy.log").read_text()
    assert f"republishing {weights.name} from the checkpoint" in trainer_log
    assert json.loads(out[out.index("{"):])["steps"] == 30
    report = check_ledgers_and_audit(run_dir, lost_shards=True)
    assert report["regenerated"] >= len(trained_tasks)  # trained samples gone, their tasks done again
