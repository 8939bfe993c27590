"""Retrieval for search agents: a BM25 index (the `bm25s` package) over a corpus of documents,
local to each process that needs it; nothing is fetched at run time.

The corpus is `tasks.corpus`, a JSONL file with one document per line (`{"text": ...}`, with
an optional `"title"` put before the text), or, for `tasks.kind: search_facts`, the generated
encyclopedia (`tasks/search_facts.py`). Every line of a file is checked when the index is
built, and `check_corpus` runs before any component starts: a bad line is a one-line error
naming the file, the line and the field.

`index_for(tasks)` builds the index once per process and config (the trainer's warm-up and
each worker build the same one: the corpus is a pure function of the config). `search`
returns the texts of the `k` best documents with a positive score, best first; a query with
no word of the corpus finds nothing. BM25 over ~10^5 documents answers in about a
millisecond, but a worker calls it through `asearch`, in a thread, so that a large corpus
never stalls its event loop.
"""
from __future__ import annotations

import asyncio
import functools
import json
import sys
import threading
from pathlib import Path
from types import ModuleType

from astraflow.config.loader import ConfigError
from astraflow.config.schema import TaskSourceConfig
from astraflow.tasks import search_facts


def load_corpus(path: str | Path) -> list[str]:
    """The documents of a JSONL corpus file, each its title (if any) and text."""
    docs = []
    try:
        with open(path, encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                docs.append(_document(line, f"{path}:{line_no}"))
    except OSError as e:
        raise ConfigError(f"tasks.corpus: cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"tasks.corpus: {path}: not UTF-8 text ({e.reason})") from None
    if not docs:
        raise ConfigError(f"tasks.corpus: {path} holds no document")
    return docs


def _document(line: str, where: str) -> str:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not a JSON object ({e.msg})") from None
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: expected a JSON object with a \"text\" field, got {type(row).__name__}")
    text, title = row.get("text"), row.get("title", "")
    if not isinstance(text, str) or not text.strip():
        raise ConfigError(f"{where}: field \"text\": expected a non-empty string, got {text!r:.60}")
    if not isinstance(title, str):
        raise ConfigError(f"{where}: field \"title\": expected a string, got {title!r:.60}")
    return f"{title}. {text}" if title else text


def corpus_of(tasks: TaskSourceConfig) -> list[str]:
    if tasks.corpus:
        return load_corpus(tasks.corpus)
    if tasks.kind == "search_facts":
        return search_facts.documents(tasks)
    raise ConfigError(f"tasks.corpus: the search workflow needs documents to search: a JSONL file here, or "
                      f"tasks.kind: search_facts (its generated corpus); tasks.kind is {tasks.kind!r}")


def _bm25s() -> ModuleType:
    """`bm25s`, imported without numba. bm25s imports numba (and with it llvmlite) whenever it
    can, and an in-process vLLM engine built afterwards in the same process died in vLLM's scan
    of every loaded module for kernels to rebind (llvmlite's function wrappers break it). Its
    numpy backend, the default, needs neither."""
    if "bm25s" not in sys.modules and "numba" not in sys.modules:
        sys.modules["numba"] = None  # type: ignore[assignment]  # `import numba` raises ImportError
        try:
            import bm25s  # noqa: F401
        finally:
            del sys.modules["numba"]
    import bm25s

    return bm25s


def _words(texts: list[str]) -> list[list[str]]:
    return _bm25s().tokenize(texts, stopwords="en", return_ids=False, show_progress=False)


class SearchIndex:
    def __init__(self, documents: list[str]) -> None:
        self.documents = documents
        self.bm25 = _bm25s().BM25(backend="numpy")
        self.bm25.index(_words(documents), show_progress=False)

    def search(self, query: str, k: int) -> list[str]:
        words = _words([query])
        if not words[0]:
            return []
        ids, scores = self.bm25.retrieve(words, k=min(k, len(self.documents)), show_progress=False)
        return [self.documents[int(i)] for i, s in zip(ids[0], scores[0]) if s > 0]

    async def asearch(self, query: str, k: int) -> list[str]:
        return await asyncio.to_thread(self.search, query, k)


_BUILDING = threading.Lock()  # a worker's first episodes all ask at once, from threads


@functools.lru_cache(maxsize=4)
def _index(tasks: TaskSourceConfig) -> SearchIndex:
    return SearchIndex(corpus_of(tasks))


def index_for(tasks: TaskSourceConfig) -> SearchIndex:
    with _BUILDING:
        return _index(tasks)


def check_corpus(tasks: TaskSourceConfig) -> int:
    """Reads and checks the corpus (ConfigError naming what is wrong); its document count."""
    return len(corpus_of(tasks))

