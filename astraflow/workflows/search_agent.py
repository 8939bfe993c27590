"""`search`: an agent that searches a corpus over several turns, then answers.

Each turn the agent writes one action (the format of Search-R1, arXiv 2503.09516):
- `<search>QUERY</search>`: the BM25 index (`environments/retrieval.py`) returns the
  `workflow.search_top_k` best documents, which come back as context, a tool turn
  `<information>...</information>`;
- `<answer>TEXT</answer>`: the episode ends; TEXT is scored against the task's answer by the
  configured reward (`token_f1` or `exact_match`).
Anything else, or no answer within `workflow.max_turns` turns, ends the episode at reward 0:
the format is part of what is learnt. With `workflow.reference_guidance`, a group whose
episodes all scored 0 gets one more, the row's reference path (its `queries`, then the
answer) forced through the engine with the documents the index really returns (`guided`, as
in `rlvr`). Meta: the queries, the answer (None without one), and
whether a search brought back a document that contains the right answer (`found`), which
tells a retrieval failure from a reading one.

The record is the whole exchange; only the agent's tokens are trained (documents are
context). Retrieval runs in a thread, never on the worker's event loop.
"""
from __future__ import annotations

import asyncio
import dataclasses
import re
import time

import numpy as np

from astraflow.config.schema import Config
from astraflow.environments.retrieval import SearchIndex, index_for
from astraflow.models.tokenizer import ModelTokenizer
from astraflow.protocol.messages import Task, Trajectory
from astraflow.tasks.sources import Item
from astraflow.workflows.api import EpisodeContext, Sequence
from astraflow.workflows.rewards import answer_words

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.S)


def action(text: str) -> tuple[str, str] | None:
    """The completion's first action: ("search", query) or ("answer", text), or None."""
    m = _ACTION.search(text)
    return (m.group(1), m.group(2).strip()) if m else None


def contains(document: str, answer: str) -> bool:
    """Whether the document holds the answer's words, in order (normalised as `token_f1` does)."""
    words, want = answer_words(document), answer_words(answer)
    return bool(want) and any(words[i:i + len(want)] == want for i in range(len(words) - len(want) + 1))


def information(documents: list[str]) -> str:
    return "<information>" + ("\n".join(documents) if documents else "No results.") + "</information>"


def search_call(query: str) -> str:
    return f"<search>{query}</search>"


def answer_call(answer: str) -> str:
    return f"<answer>{answer}</answer>"


async def search(task: Task, ctx: EpisodeContext) -> list[Trajectory]:
    agent = ctx.roles["agent"]
    index_no, engine = ctx.policy_index[agent], ctx.engines[agent]
    index: SearchIndex = await asyncio.to_thread(index_for, ctx.tasks)  # built once per process
    k = ctx.workflow.search_top_k

    async def one(script: tuple[tuple[int, ...], ...] = ()) -> Trajectory:
        """An episode; with `script`, the turns' completions are forced (the reference path)."""
        t0 = time.perf_counter()
        seq = Sequence(ctx.prompt_ids(task))
        queries: list[str] = []
        answer, reward, found = None, 0.0, False
        for turn in range(len(script) or ctx.workflow.max_turns):
            params = dataclasses.replace(ctx.sampling(), forced=script[turn]) if script else ctx.sampling()
            completion = await engine.generate(seq.ids, params)
            seq.add_completion(index_no, completion)
            act = action(ctx.tokenizer.decode(completion.tokens))
            if act is None:
                break
            kind, text = act
            if kind == "answer":
                answer, reward = text, await ctx.score(text, task)
                break
            queries.append(text)
            documents = await index.asearch(text, k)
            found = found or any(contains(d, task.answer) for d in documents)
            seq.add_context(ctx.tokenizer.encode_turns([{"role": "tool", "content": information(documents)}],
                                                       completion.finished))
        meta = {"queries": queries, "answer": answer, "searches": len(queries), "found": found,
                **({"guided": True} if script else {})}
        return seq.record(agent, index_no, reward, task.task_id, ctx.episode_id(), time.perf_counter() - t0, meta)

    group = list(await asyncio.gather(*(one() for _ in range(task.group_size))))
    reference = task.row.get("queries")
    if ctx.workflow.reference_guidance and reference and not any(t.reward > 0 for t in group):
        calls = [*map(search_call, reference), answer_call(task.answer)]
        group.append(await one(tuple(tuple(ctx.tokenizer.encode_completion(c)) for c in calls)))
    return group


def warmup_examples(role: str, items: list[Item], tokenizer: ModelTokenizer, rng: np.random.Generator,
                    cfg: Config) -> list[tuple[list[int], list[int]]]:
    """The search format: each search of the row's `queries` (with the documents the index
    really returns), then the answer (a row without `queries` answers at once; the input
    checks refuse a warm-up in which no row has them)."""
    index, k = index_for(cfg.tasks), cfg.workflow.search_top_k
    pairs = []
    for item in items:
        queries = item.row.get("queries") or []
        context = tokenizer.encode_prompt(item.prompt, item.messages)
        for query in queries:
            call = tokenizer.encode_completion(search_call(query))
            pairs.append((context, call))
            found = tokenizer.encode_turns([{"role": "tool", "content": information(index.search(query, k))}], True)
            context = [*context, *call, *found]
        pairs.append((context, tokenizer.encode_completion(answer_call(item.answer))))
    return pairs
