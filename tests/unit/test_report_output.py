"""What `inspect` and `audit` print is labelled (no bare numbers, no Python reprs); a shard
describes its columns (units, meanings, the -1 of no version) to plain h5py; `inspect` counts
the records stored before a first publish apart instead of calling their lag 0; a reader
that closes the pipe early (`| head`) ends the command without a traceback."""
from __future__ import annotations

import subprocess
import sys

import h5py

from astraflow.analysis.audit import audit, format_audit
from astraflow.analysis.inspect import format_report, inspect_run
from astraflow.store.reader import load_rows
from astraflow.store.schema import ROW_COLUMNS, TOKEN_COLUMNS
from astraflow.store.writer import list_shards
from tests.conftest import REPO, trained_run_dir


def test_a_shard_describes_its_columns_to_plain_h5py(tmp_path):
    run = trained_run_dir(tmp_path)
    with h5py.File(list_shards(run / "shards")[0], "r") as f:
        rows = f["rows"].attrs
        assert set(ROW_COLUMNS) <= set(rows)
        assert "seconds" in rows["gen_s"] and "Unix epoch" in rows["t_commit"]
        assert "-1" in rows["version_at_commit"] and "published" in rows["version_at_commit"]
        assert all("description" in f[c].attrs for c in TOKEN_COLUMNS)
        assert "-1" in f["versions"].attrs["description"] and f.attrs["version_none"] == -1


def test_inspect_counts_records_stored_before_the_first_publish_apart(tmp_path):
    run = trained_run_dir(tmp_path)  # every commit before the first publish: version_at_commit -1
    assert (load_rows(run)["version_at_commit"] == -1).all()
    policy = inspect_run(run, live=False)["policies"]["policy"]
    assert policy["version_lag"] == {} and policy["before_first_publish"] == 32


def test_inspect_and_audit_label_what_they_print(tmp_path):
    run = trained_run_dir(tmp_path)
    text = format_report(inspect_run(run, live=False))
    timeline = next(line for line in text.splitlines() if "timeline" in line)
    assert "trajectories and their mean reward per tenth of the run" in timeline and "(0.50)" in timeline
    assert "before the first publish: 32" in text
    audit_text = format_audit(audit(run))
    assert "trained policy: 32" in audit_text and "{" not in audit_text


def test_a_closed_pipe_ends_inspect_without_a_traceback(tmp_path):
    run = trained_run_dir(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "inspect", "--json", str(run)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # as `| head` does once it has its lines: every write now fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
