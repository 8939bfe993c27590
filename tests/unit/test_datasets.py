"""Data sets as prompt sources: JSONL, Parquet and saved `datasets` directories, field
mapping, chat messages, splits that stay put when rows are appended, and a bad row named by
its file, line (or row) and field."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from datasets import Dataset, DatasetDict

from astraflow.config.loader import ConfigError
from astraflow.config.schema import TaskSourceConfig
from astraflow.tasks.sources import TaskSource

ROWS = [{"question": f"What is {i} + {i % 7}?", "solution": f"{i} + {i % 7} = {i + i % 7}", "gold": i + i % 7,
         "level": i % 3} for i in range(300)]


def write(tmp_path, kind: str, rows: list[dict]):
    if kind == "jsonl":
        path = tmp_path / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == "parquet":
        path = tmp_path / "data.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=64)
    else:
        path = tmp_path / "saved"
        DatasetDict({"train": Dataset.from_list(rows)}).save_to_disk(str(path))
    return path


def config(kind: str, path, **kw) -> TaskSourceConfig:
    return TaskSourceConfig(kind=kind, path=str(path), split="train" if kind == "hf_disk" else "",
                            prompt_key="question", answer_key="gold", solution_key="solution", **kw)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_disk"])
def test_every_format_maps_fields_and_splits_by_content(tmp_path, kind):
    src = TaskSource(config(kind, write(tmp_path, kind, ROWS), heldout=0.1, warmup=20))
    assert len(src.heldout) + len(src.warmup) + len(src.train) == len(ROWS) and len(src.warmup) == 20
    item = src.item(0)
    row = next(r for r in ROWS if r["question"] == item.prompt)
    assert item.answer == str(row["gold"]) and item.target == row["solution"] and item.row == {"level": row["level"]}
    assert not {i.prompt for i in src.heldout} & {i.prompt for i in src.train}
    assert sorted(src.item(i).prompt for i in range(len(src.train))) == sorted(i.prompt for i in src.train)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "hf_disk"])
def test_a_fractional_split_keeps_every_row_where_it_was_when_rows_are_appended(tmp_path, kind):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = TaskSource(config(kind, write(tmp_path / "a", kind, ROWS), heldout=0.2))
    more = ROWS + [{**r, "question": r["question"] + " Exactly?"} for r in ROWS[:100]]
    after = TaskSource(config(kind, write(tmp_path / "b", kind, more), heldout=0.2))
    old = {i.prompt for i in before.heldout}
    assert old <= {i.prompt for i in after.heldout}  # held out before: held out still
    assert not old & {i.prompt for i in after.train}


def test_chat_messages_as_the_prompt(tmp_path):
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i}?"}],
             "answer": str(i)} for i in range(50)]
    src = TaskSource(TaskSourceConfig(kind="jsonl", path=str(write(tmp_path, "jsonl", rows)), messages_key="messages",
                                      heldout=5))
    item = src.item(3)
    assert item.prompt == "" and item.messages[0] == {"role": "system", "content": "Be brief."}
    assert item.messages[1]["content"] == f"{item.answer}?"


@pytest.mark.parametrize("kind, where", [("jsonl", r"data.jsonl:58"), ("parquet", r"data.parquet: row 57"),
                                         ("hf_disk", r"saved: row 57")])
@pytest.mark.parametrize("bad, message", [
    ({"gold": None}, r"field 'gold': expected a string or a number, got NoneType null"),
    ({"question": ""}, r"field 'question': expected a non-empty string"),
])
def test_a_bad_row_is_named_by_file_line_and_field(tmp_path, kind, where, bad, message):
    rows = [dict(r) for r in ROWS]
    rows[57].update(bad)
    with pytest.raises(ConfigError, match=rf"{where}: {message}"):
        TaskSource(config(kind, write(tmp_path, kind, rows), heldout=10))


def test_a_json_row_of_the_wrong_type_or_without_a_field(tmp_path):
    rows = [dict(r) for r in ROWS]
    rows[3]["gold"] = True
    del rows[9]["question"]
    with pytest.raises(ConfigError, match=r"data.jsonl:4: field 'gold': expected a string or a number, got bool"):
        TaskSource(config("jsonl", write(tmp_path, "jsonl", rows)))
    rows[3]["gold"] = 1
    with pytest.raises(ConfigError, match=r"data.jsonl:10: field 'question': expected a non-empty string, missing"):
        TaskSource(config("jsonl", write(tmp_path, "jsonl", rows)))


def test_missing_fields_files_and_splits_are_named(tmp_path):
    path = write(tmp_path, "parquet", ROWS)
    with pytest.raises(ConfigError, match=r"data.parquet: no field 'prompt'; the data set has \['question'"):
        TaskSource(TaskSourceConfig(kind="parquet", path=str(path), answer_key="gold"))
    with pytest.raises(ConfigError, match=r"tasks.path: .*nothing.jsonl does not exist"):
        TaskSource(TaskSourceConfig(kind="jsonl", path=str(tmp_path / "nothing.jsonl")))
    saved = write(tmp_path, "hf_disk", ROWS)
    with pytest.raises(ConfigError, match=r"tasks.split: 'test' is not a split of .*saved; expected one of \['train'\]"):
        TaskSource(TaskSourceConfig(kind="hf_disk", path=str(saved), split="test", prompt_key="question",
                                    answer_key="gold"))
    (tmp_path / "junk.jsonl").write_text('{"prompt": "1?", "answer": 1}\n[1, 2]\n')
    with pytest.raises(ConfigError, match=r"junk.jsonl:2: expected a JSON object, got list"):
        TaskSource(TaskSourceConfig(kind="jsonl", path=str(tmp_path / "junk.jsonl"), heldout=0))


def test_word_problems_are_stories_with_worked_solutions():
    src = TaskSource(TaskSourceConfig(kind="word_problems", operands=3, max_operand=12, heldout=50, seed=1))
    item = src.item(0)
    steps = item.solution.splitlines()
    assert item.prompt.endswith("?") and len(steps) == 3 and steps[-1] == f"The answer is \\boxed{{{item.answer}}}."
    for line in steps[:-1]:
        a, op, b, _, r = line.split()
        assert int(r) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    assert TaskSource(TaskSourceConfig(kind="word_problems", seed=1, heldout=50)).item(7) == \
        TaskSource(TaskSourceConfig(kind="word_problems", seed=1, heldout=50)).item(7)
