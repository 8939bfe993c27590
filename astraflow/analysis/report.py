"""`astraflow report RUN_DIR [-o report.html]`: one self-contained HTML page per run.

What a person asks of a finished (or live) run, from its own files: the training curve and
held-out accuracy per policy, the counts of what was stored, trained, dropped (stale),
filtered (zero advantage) and left unused, the version lag, throughput per partition and
per worker (partitions from the workers' registrations in the journal), the
slowest episodes, sample completions with their rewards, and the config. Images are PNGs
inlined as data: URIs and the style is inline, so the page needs no network and no other
file (mail it, attach it to a ticket). Everything shown is escaped.
"""
from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path
from typing import Any, Iterable

from astraflow.analysis.inspect import inspect_run
from astraflow.analysis.plot import save_curve
from astraflow.config.rundir import RunDir, existing_run
from astraflow.store.journal import replay
from astraflow.store.reader import load_rows, load_trajectory

DEFAULT_NAME = "report.html"
SLOWEST = 10
SAMPLES_PER_POLICY = 3
STYLE = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:.25em .6em;"
         "text-align:left;vertical-align:top}th{background:#f3f3f3}pre{background:#f7f7f7;padding:.8em;"
         "white-space:pre-wrap;word-break:break-all}img{max-width:100%}")


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the page (default: RUN_DIR/report.html); returns where."""
    run_dir = existing_run(run_dir)
    out = Path(out) if out is not None else run_dir / DEFAULT_NAME
    out.write_text(render_report(run_dir))
    return out


def render_report(run_dir: Path) -> str:
    run = RunDir.open(run_dir)
    facts = inspect_run(run_dir, live=False)
    rows = load_rows(run_dir)
    summary = _json(run_dir / "summary.json")
    evals = _json(run_dir / "eval.json").get("eval", {})
    parts = [f"<h1>{_e(run.config.run.name)}: {_e(run_dir.name)}</h1>",
             f"<p>{_e(str(run_dir.resolve()))}; {facts['trajectories']} trajectories from {facts['tasks']} tasks in "
             f"{len(facts['shards'])} shards" + (f"; {summary['wall_s']:.1f} s wall time" if "wall_s" in summary
                                                 else "; no summary.json (the run has not finished)") + "</p>",
             "<h2>Training curve</h2>", _img(lambda f: save_curve(run_dir, f), "training curve"),
             "<h2>Results per policy</h2>", _results(run, facts, summary, evals),
             "<h2>What happened to the samples</h2>", _counts(facts, summary),
             "<h2>Version lag</h2>", _lag(facts),
             "<h2>Throughput per partition and worker</h2>", _workers(run_dir, rows),
             "<h2>Slowest episodes</h2>", _slowest(rows),
             "<h2>Sample completions</h2>", _samples(run, rows),
             "<h2>Config</h2>", f"<pre>{_e((run_dir / 'config.yaml').read_text())}</pre>"]
    head = (f'<head><meta charset="utf-8"><title>AstraFlow report: {_e(run_dir.name)}</title>'
            f"<style>{STYLE}</style></head>")
    return f'<!DOCTYPE html>\n<html lang="en">{head}<body>\n' + "\n".join(parts) + "\n</body></html>\n"


def _e(text: Any) -> str:
    return html.escape(str(text))


def _json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _table(header: Iterable[str], body: Iterable[Iterable[Any]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    rows = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><tr>{head}</tr>{rows}</table>"


def _img(draw: Any, alt: str) -> str:
    buf = io.BytesIO()
    draw(buf)
    return f'<img alt="{_e(alt)}" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def _num(x: Any, fmt: str = ".3f") -> str:
    return "-" if x is None or x != x else format(x, fmt)


def _results(run: RunDir, facts: dict, summary: dict, evals: dict) -> str:
    body = []
    for name in run.config.policy_names:
        p, s, e = facts["policies"].get(name, {}), summary.get("policies", {}).get(name, {}), evals.get(name, {})
        body.append([name, s.get("steps", p.get("trainer_step", 0)), _num(s.get("reward_first")),
                     _num(s.get("reward_last")), _num(p.get("reward_mean")),
                     f"{e.get('metric', '')} {_num(e.get('base'))} -> {_num(e.get('last'))}" if e else "-",
                     p.get("trajectories", 0), p.get("tokens", 0)])
    table = _table(["policy", "steps", "reward, first 10%", "reward, last 10%", "reward, all stored",
                    "held-out (greedy): start -> end", "trajectories", "tokens"], body)
    skipped = summary.get("eval_skipped") or summary.get("eval_error")
    return table + (f"<p>Held-out evaluation: {_e(skipped)}</p>" if skipped else "")


def _counts(facts: dict, summary: dict) -> str:
    keys = [("trajectories", "stored"), ("generated", "generated by the policies"),
            ("guided", "guided (reference answers added, not sampled)"), ("trained", "trained"),
            ("dropped_stale", "dropped: too stale"), ("filtered_zero_advantage", "filtered: zero advantage"),
            ("unused_trainer_done", "unused: the trainer had finished"), ("skipped_prompts", "prompts skipped")]
    body = [[label, summary[k]] for k, label in keys if k in summary]
    body += [["shards quarantined", len(facts["quarantined"])], ["shards unreadable", len(facts["unreadable"])],
             ["torn rows ignored", sum(facts["torn_rows"].values())]]
    return _table(["", "count"], body)


def _lag(facts: dict) -> str:
    body = []
    for name, p in facts["policies"].items():
        body += [[name, lag, n] for lag, n in p["version_lag"].items()]
        if p.get("before_first_publish"):
            body.append([name, "none (stored before the first publish)", p["before_first_publish"]])
    return ("<p>Versions behind the latest published weights when a trajectory was stored.</p>"
            + _table(["policy", "lag", "trajectories"], body))


def _registered(run_dir: Path) -> dict[str, dict]:
    """worker id -> its last `register` event in the journal (partition, hardware, host)."""
    return {ev["worker"]: ev for ev in replay(run_dir / "journal") if ev.get("ev") == "register" and "worker" in ev}


def _rates(groups: Any) -> list[list[Any]]:
    """Per group of rows: trajectories, tokens, tokens/s over the group's span of commits."""
    out = []
    for key, g in groups:
        span = float(g["t_commit"].max() - g["t_commit"].min())
        out.append([key, len(g), int(g["length"].sum()), _num(g["length"].sum() / span if span else None, ".0f"),
                    _num(g["gen_s"].mean(), ".2f")])
    return out


def _workers(run_dir: Path, rows: Any) -> str:
    if not len(rows):
        return "<p>No trajectories.</p>"
    registered = _registered(run_dir)
    rows = rows.assign(partition=[registered.get(w, {}).get("partition") or "local" for w in rows["worker"]])
    columns = ["trajectories", "tokens", "tokens/s while active", "mean generation s"]
    workers = _rates(rows.groupby("worker"))
    for r in workers:
        r.insert(1, registered.get(r[0], {}).get("partition") or "local")
        r.insert(2, registered.get(r[0], {}).get("hardware", ""))
    return (_table(["partition", *columns], _rates(rows.groupby("partition")))
            + _table(["worker", "partition", "hardware", *columns], workers))


def _slowest(rows: Any) -> str:
    if not len(rows):
        return "<p>No trajectories.</p>"
    top = rows.sort_values("gen_s", ascending=False).head(SLOWEST)
    return _table(["generation s", "policy", "worker", "task", "sample", "tokens", "reward"],
                  [[_num(r.gen_s, ".2f"), r.policy, r.worker, r.task_id, r.sample_id, r.length, _num(r.reward, ".2f")]
                   for r in top.itertuples()])


def _samples(run: RunDir, rows: Any) -> str:
    """The last few generated (not guided) trajectories of each policy, decoded."""
    if not len(rows):
        return "<p>No trajectories.</p>"
    decode = _decoder(run)
    out = []
    for name, g in rows[rows["guided"] == 0].groupby("policy"):
        for r in g.tail(SAMPLES_PER_POLICY).itertuples():
            t = load_trajectory(run.path, r.shard, r.row)
            mask = t["loss_mask"].astype(bool)
            first = int(mask.argmax()) if mask.any() else len(mask)
            out.append(f"<h3>{_e(name)}: sample {r.sample_id}, reward {_num(r.reward, '.2f')}</h3>"
                       f"<pre>{_e(decode(t['tokens'][:first]))}<b>{_e(decode(t['tokens'][first:]))}</b></pre>")
    return "<p>The prompt, then the completion in bold.</p>" + "".join(out)


def _decoder(run: RunDir) -> Any:
    """The run's tokenizer as text; token ids where the model directory cannot be read."""
    from astraflow.models import base_model_dir
    from astraflow.models.tokenizer import load_hf_tokenizer

    try:
        tokenizer = load_hf_tokenizer(base_model_dir(run.path, run.config.model.path))
    except (OSError, ValueError):
        return lambda ids: " ".join(map(str, ids))
    return lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False)
