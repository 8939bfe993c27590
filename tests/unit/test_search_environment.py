"""The search environment: the generated encyclopedia (every question's searches find its
evidence in the real BM25 index), a user's JSONL corpus with its errors named by line and
field, the action format, word F1, and the input checks that refuse a search run with nothing
to search. The workflow end to end (a real model searching, documents as context) is in
tests/integration/test_search_run.py."""
from __future__ import annotations

import pytest

from astraflow.config.loader import ConfigError, load_config, parse_config
from astraflow.config.schema import TaskSourceConfig
from astraflow.environments.retrieval import SearchIndex, corpus_of, index_for, load_corpus
from astraflow.launch.inputs import check_inputs
from astraflow.tasks.search_facts import documents, search_facts, world
from astraflow.workflows.rewards import Scorer, token_f1
from astraflow.workflows.search_agent import action, contains

FACTS = TaskSourceConfig(kind="search_facts", entities=60, hops=2, workflow="search")


def test_every_question_is_answered_by_what_its_searches_find():
    """Top-1 BM25 on each of a row's queries returns the document that holds the next query
    (two hops: the person's document names the town) and, last, the answer."""
    items = list(search_facts(FACTS))
    towns, people = world(FACTS)
    assert len(items) == 3 * len(towns) + 6 * len(people) and len({i.prompt for i in items}) == len(items)
    index = index_for(FACTS)
    for item in items:
        queries = item.row["queries"]
        for query, following in zip(queries, [*queries[1:], item.answer]):
            (doc,) = index.search(query, 1)
            assert query in doc and contains(doc, following), (item.prompt, query, doc)


def test_the_corpus_is_a_function_of_the_config():
    assert documents(FACTS) == documents(FACTS)
    assert documents(FACTS) != documents(TaskSourceConfig(kind="search_facts", entities=60, seed=1))
    assert len(documents(FACTS)) == 60 + 15


def test_a_search_finds_nothing_for_words_the_corpus_lacks_and_at_most_k_documents():
    index = SearchIndex(["Varnholt is a town.", "Anna Pell lives in Varnholt.", "Dorsk is a town."])
    assert index.search("zebra quantum", 3) == [] and index.search("", 3) == []
    assert index.search("Anna Pell", 1) == ["Anna Pell lives in Varnholt."]
    assert len(index.search("Varnholt town", 2)) == 2


def test_a_jsonl_corpus_puts_titles_before_texts(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"title": "Varnholt", "text": "A town on the Elm."}\n\n{"text": "Dorsk is a city."}\n')
    assert load_corpus(path) == ["Varnholt. A town on the Elm.", "Dorsk is a city."]
    cfg = TaskSourceConfig(kind="jsonl", path="q.jsonl", workflow="search", corpus=str(path))
    assert corpus_of(cfg) == load_corpus(path)


@pytest.mark.parametrize("lines, message", [
    ('{"text": "ok"}\nnot json\n', ":2: not a JSON object"),
    ('{"text": "ok"}\n["a list"]\n', ":2: expected a JSON object"),
    ('{"text": ""}\n', ':1: field "text": expected a non-empty string'),
    ('{"body": "no text"}\n', ':1: field "text"'),
    ('{"text": "t", "title": 3}\n', ':1: field "title": expected a string'),
    ("\n\n", "holds no document"),
])
def test_a_bad_corpus_line_is_named_by_line_and_field(tmp_path, lines, message):
    path = tmp_path / "docs.jsonl"
    path.write_text(lines)
    with pytest.raises(ConfigError, match=message):
        load_corpus(path)


def test_actions_are_read_from_the_first_tag_pair():
    assert action("<search> Tom Ashby </search>") == ("search", "Tom Ashby")
    assert action("<answer>1342</answer><search>x</search>") == ("answer", "1342")
    assert action("1342") is None and action("<search>unclosed") is None


def test_word_f1_normalises_case_punctuation_and_articles():
    assert token_f1("The river Elm.", "Elm") == pytest.approx(2 / 3)
    assert token_f1("elm", "Elm") == 1.0 and token_f1("Oder", "Elm") == 0.0 and token_f1("", "Elm") == 0.0
    assert contains("Varnholt has 38 bridges.", "38") and not contains("founded in 1387", "38")
    scorer = Scorer("token_f1", 5.0)
    assert scorer.builtin


def test_the_search_config_checks_out_and_a_search_without_a_corpus_is_refused(tmp_path):
    check_inputs(load_config("configs/search.yaml"))
    with pytest.raises(ConfigError, match="tasks.corpus: the search workflow needs documents"):
        parse_config("tasks: {kind: arithmetic, workflow: search}\npolicies: [{name: a, role: agent}]\n")
    with pytest.raises(ConfigError, match="tasks.hops: expected 1 or 2"):
        parse_config("tasks: {kind: search_facts, hops: 3, workflow: search}\npolicies: [{name: a, role: agent}]\n")
    bad = tmp_path / "docs.jsonl"
    bad.write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(f'{{"prompt": "Where is {i}?", "answer": "{i}"}}\n' for i in range(20)))
    cfg = parse_config(f"tasks: {{kind: jsonl, path: {questions}, heldout: 2, workflow: search, corpus: {bad}}}\n"
                       "warmup: {steps: 0}\npolicies: [{name: a, role: agent}]\n")
    with pytest.raises(ConfigError, match=r"docs.jsonl:2: field \"text\""):
        check_inputs(cfg)
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "fine"}\n')
    warm = parse_config(f"tasks: {{kind: jsonl, path: {questions}, heldout: 2, warmup: 5, workflow: search, "
                        f"corpus: {good}}}\nwarmup: {{steps: 10}}\npolicies: [{{name: a, role: agent}}]\n")
    with pytest.raises(ConfigError, match="no warm-up row has one"):
        check_inputs(warm)
