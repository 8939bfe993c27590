"""`astraflow report`: one self-contained HTML page, checked structurally here: it parses
with every element closed, has each section, holds its images inline as PNG data (nothing
fetched from anywhere), decodes sample completions with the run's tokenizer, and escapes
what the run wrote (a worker id with markup). How a browser shows it: test_report_browser.py."""
from __future__ import annotations

import base64
from html.parser import HTMLParser

from astraflow.cli.main import main
from astraflow.store.journal import Journal
from tests.conftest import EPISODES, text_run_dir, trained_run_dir

SECTIONS = ["Training curve", "Results per policy", "What happened to the samples", "Version lag",
            "Throughput per partition and worker", "Slowest episodes", "Sample completions", "Config"]
VOID = {"meta", "img", "br", "hr", "link"}


class Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.open: list[str] = []
        self.sections: list[str] = []
        self.images: list[str] = []
        self.refs: list[str] = []  # every src / href
        self.text: list[str] = []
        self.unbalanced: list[str] = []
        self._in_h2 = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.refs += [v for k, v in attrs.items() if k in ("src", "href")]
        if tag == "img":
            self.images.append(attrs["src"])
        if tag not in VOID:
            self.open.append(tag)
        self._in_h2 = tag == "h2"

    def handle_endtag(self, tag):
        if not self.open or self.open.pop() != tag:
            self.unbalanced.append(tag)
        self._in_h2 = False

    def handle_data(self, data):
        self.text.append(data)
        if self._in_h2:
            self.sections.append(data)


def parse(path) -> Page:
    page = Page()
    page.feed(path.read_text())
    page.close()
    return page


def test_the_report_is_one_self_contained_page_with_every_section(tmp_path, capsys):
    run = text_run_dir(tmp_path)
    journal = Journal(run / "journal")  # the worker's registration, as the rank journals it
    journal.append("register", base="w", k=0, worker="w<0>&", partition="gpu-a100", hardware="cpu")
    journal.close()
    assert main(["report", str(run)]) == 0
    out = run / "report.html"
    assert capsys.readouterr().out.strip() == str(out)
    page = parse(out)
    assert page.sections == SECTIONS and not page.open and not page.unbalanced
    assert page.images and all(src.startswith("data:image/png;base64,") for src in page.images)
    assert all(base64.b64decode(src.split(",", 1)[1])[:8] == b"\x89PNG\r\n\x1a\n" for src in page.images)
    assert all(ref.startswith("data:") for ref in page.refs)  # no network, no other file
    text = "".join(page.text)
    for prompt, completion, _ in EPISODES:
        assert prompt + completion in text  # decoded by the run's tokenizer
    assert "w<0>&" in text and "w<0>&" not in out.read_text()  # escaped markup
    assert "max_staleness: 2" in text  # the config
    assert "gpu-a100" in text  # throughput per partition


def test_a_run_without_a_tokenizer_or_summary_still_reports(tmp_path):
    run = trained_run_dir(tmp_path)  # random token ids, no model directory, not finished
    out = tmp_path / "r.html"
    assert main(["report", str(run), "-o", str(out)]) == 0
    page = parse(out)
    assert page.sections == SECTIONS and not page.unbalanced
    assert "no summary.json" in "".join(page.text)
