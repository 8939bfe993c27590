"""`astraflow report` in a real browser (headless Chromium, tests/browser.py): the page loads
with no console error, no uncaught exception and no error logged, shows every section, and
every plot decodes and is drawn with a size. The checker itself is shown to catch what it
looks for, on a page with a console error, an exception and a broken image. The report of a
whole `astraflow run` is checked the same way in tests/integration/test_local_run.py."""
from __future__ import annotations

from astraflow.analysis.report import write_report
from astraflow.analysis.sinks import CsvSink
from tests.browser import assert_shows_report, render
from tests.conftest import EPISODES, text_run_dir
from tests.unit.test_report import SECTIONS

CURVE = ("step", "time", "reward_mean", "reward_trained", "generated")  # the columns the curve draws


def test_the_report_loads_in_chromium_without_errors_and_shows_its_plots(tmp_path):
    run = text_run_dir(tmp_path)
    sink = CsvSink(run, "policy", CURVE)  # the training curve's rows, as a trainer writes them
    for step in range(1, 6):
        sink.scalars({"step": step, "time": 1e9 + step, "reward_mean": step / 5, "reward_trained": step / 6,
                      "generated": 16}, step, 1e9 + step)
    shown = render(write_report(run, tmp_path / "report.html"))
    assert_shows_report(shown, SECTIONS)
    assert EPISODES[0][0] + EPISODES[0][1] in shown.text  # a sample completion, decoded, as text on the page


def test_the_browser_check_sees_console_errors_exceptions_and_broken_images(tmp_path):
    page = tmp_path / "bad.html"
    page.write_text('<!DOCTYPE html><html><body><h2>A</h2><img alt="plot" src="data:image/png;base64,AAAA">'
                    '<script>console.error("boom"); null.x;</script></body></html>')
    shown = render(page)
    assert shown.errors[0] == "console: boom" and shown.errors[1].startswith("exception: TypeError")
    assert shown.headings == ["A"] and shown.images[0]["natural"] == 0  # not decoded: not shown as a plot
