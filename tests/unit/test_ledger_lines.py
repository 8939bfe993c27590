"""A client's ledger line lands whole or not at all. The file-size limit (RLIMIT_FSIZE) makes
the kernel cut a write short exactly as a full filesystem does, without root: the line that
does not fit is taken back, and the lines after it (once there is room) are whole."""
from __future__ import annotations

import json
import subprocess
import sys

from astraflow.analysis.ledgers import _lines
from astraflow.appendonly import append_json_line

CHILD = """
import resource, signal, sys
from pathlib import Path
from astraflow.appendonly import append_json_line
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the limit answers with EFBIG, not a killed process
path, limit = Path(sys.argv[1]), int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
append_json_line(path, {"task": 1, "sids": list(range(10))})
try:
    append_json_line(path, {"task": 2, "sids": list(range(100))})  # crosses the limit part-way
except OSError as e:
    print("refused:", e)
"""


def test_a_line_cut_short_is_taken_back_and_the_next_one_is_whole(tmp_path):
    ledger = tmp_path / "acks-w.jsonl"
    first = len(json.dumps({"task": 1, "sids": list(range(10))})) + 1
    out = subprocess.run([sys.executable, "-c", CHILD, str(ledger), str(first + 40)], capture_output=True,
                         text=True, check=True).stdout
    assert out.startswith("refused:") and ledger.stat().st_size == first  # nothing of line 2 left behind
    append_json_line(ledger, {"task": 3, "sids": [7]})  # room again
    assert [json.loads(line)["task"] for line in ledger.read_text().splitlines()] == [1, 3]
    assert [e["task"] for e in _lines(ledger)] == [1, 3]


def test_a_ledger_is_created_private_and_appended_to(tmp_path):
    ledger = tmp_path / "policy.consumed.jsonl"
    for step in (1, 2):
        append_json_line(ledger, {"step": step, "ids": [step]})
    assert ledger.stat().st_mode & 0o777 == 0o600
    assert [e["step"] for e in _lines(ledger)] == [1, 2]
