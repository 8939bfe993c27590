"""The run's line files (a client's ledger, the rank's journal) take a line whole or not at
all. The file-size limit (RLIMIT_FSIZE) makes the kernel cut a write short exactly as a full
filesystem does, without root: the line that does not fit is taken back, the writer raises,
and the lines after it (once there is room) are whole."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from astraflow.analysis.ledgers import _lines
from astraflow.store.appendonly import append_json_line
from astraflow.store.journal import Journal, replay

CHILD = """
import resource, signal, sys
from pathlib import Path
from astraflow.store.appendonly import append_json_line
from astraflow.store.journal import Journal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the limit answers with EFBIG, not a killed process
kind, path, limit = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
if kind == "ledger":
    append_json_line(path, {"task": 1, "sids": list(range(10))})
    write = lambda: append_json_line(path, {"task": 2, "sids": list(range(100))})
else:
    journal = Journal(path.parent)
    journal.append("served", step=1, ids=list(range(10)))
    journal.flush()
    journal.append("served", step=2, ids=list(range(100)))
    write = journal.flush
try:
    write()  # crosses the limit part-way
except OSError as e:
    print("refused:", e)
"""


@pytest.mark.parametrize("kind", ["ledger", "journal"])
def test_a_line_cut_short_is_taken_back_and_the_next_one_is_whole(tmp_path, kind):
    path = tmp_path / ("acks-w.jsonl" if kind == "ledger" else "journal.jsonl")
    first = {"ledger": len(json.dumps({"task": 1, "sids": list(range(10))})),
             "journal": len(json.dumps({"ev": "served", "step": 1, "ids": list(range(10))}, separators=(",", ":")))}
    size = first[kind] + 1
    out = subprocess.run([sys.executable, "-c", CHILD, kind, str(path), str(size + 40)], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("refused:") and path.stat().st_size == size, out  # nothing of line 2 left behind
    if kind == "ledger":
        append_json_line(path, {"task": 3, "sids": [7]})  # room again
        assert [json.loads(line)["task"] for line in path.read_text().splitlines()] == [1, 3]
        assert [e["task"] for e in _lines(path)] == [1, 3]
    else:
        journal = Journal(tmp_path)
        journal.append("served", step=3, ids=[7])
        journal.close()
        assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 3]
        assert [e["step"] for e in replay(tmp_path)] == [1, 3]


def test_a_ledger_is_created_private_and_appended_to(tmp_path):
    ledger = tmp_path / "policy.consumed.jsonl"
    for step in (1, 2):
        append_json_line(ledger, {"step": step, "ids": [step]})
    assert ledger.stat().st_mode & 0o777 == 0o600
    assert [e["step"] for e in _lines(ledger)] == [1, 2]
