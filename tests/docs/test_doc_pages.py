"""The pages under docs/ (and the README): every runnable code block runs, every ``dualpath`` command line in any
bash block (run or not) is one the CLI accepts, every Python block compiles, and every repository path and
``dualpath.*`` name the prose mentions exists. ``doc_blocks`` says how blocks are marked and run."""

import importlib
import re

import pytest

from doc_blocks import ROOT, RUNS, SHOWN, blocks, commands, marks_without_blocks, module_refs, pages, parse_error
from doc_blocks import page_name, path_refs, run_blocks

DOC_PAGES = [p for p in pages() if p.name != "README.md"]
# pages whose examples take seconds each (a server's worth of requests, models loaded): the slow tier runs them; by
# default their command lines still parse and their Python still compiles (below), and the README's examples run
HEAVY_PAGES = {"api.md", "quickstart.md", "offline.md", "rollouts.md", "tools.md"}
LOGGERS = {"dualpath.access", "dualpath.stats"}  # logger names the docs give, not modules


@pytest.mark.parametrize(
    "page",
    [pytest.param(p, marks=pytest.mark.slow) if p.name in HEAVY_PAGES else p for p in DOC_PAGES],
    ids=page_name,
)
def test_the_pages_examples_run(page, doc_servers, tmp_path):
    todo = [b for b in blocks(page) if b.runs() and not b.slow()]
    if not todo:
        pytest.skip("no block to run here")
    run_blocks(todo, doc_servers, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in pages() if any(b.runs() and b.slow() for b in blocks(p))], ids=page_name)
def test_the_pages_slow_examples_run(page, doc_servers, tmp_path):
    """The whole page, slow blocks included, in order (a slow block's namespace may be a later block's)."""
    run_blocks([b for b in blocks(page) if b.runs()], doc_servers, tmp_path)


def test_every_block_says_what_it_is_and_every_marker_marks_one():
    bad = []
    for page in pages():
        bad += marks_without_blocks(page)
        for b in blocks(page):
            if b.lang not in RUNS + SHOWN:
                bad.append(f"{b.where}: a block in {b.lang or 'no language'} (give python, bash or {', '.join(SHOWN)})")
            if b.kind in ("skip", "slow") and not b.note.startswith("("):
                bad.append(f"{b.where}: a {b.kind} marker says why, in parentheses")
    assert not bad, "\n".join(bad)


def test_every_dualpath_command_line_is_one_the_cli_takes():
    bad, seen = [], 0
    for page in pages():
        for b in blocks(page):
            if b.lang != "bash":
                continue
            for argv in commands(b.code):
                seen += 1
                err = parse_error(argv)
                if err:
                    bad.append(f"{b.where}: dualpath {' '.join(argv)}\n    {err.splitlines()[-1]}")
    assert seen > 30
    assert not bad, "\n".join(bad)


def test_every_python_block_compiles():
    for page in pages():
        for b in blocks(page):
            if b.lang == "python":
                compile(b.code, b.where, "exec")


def test_the_paths_and_names_the_docs_mention_exist():
    missing = []
    for page in pages():
        text = page.read_text()
        for ref in sorted(path_refs(text)):
            if not (ROOT / ref).exists():
                missing.append(f"{page_name(page)}: {ref}")
        for ref in sorted(module_refs(text)):
            if ref in LOGGERS or ref.split(".")[1][:1].isupper():  # a gRPC service's name (dualpath.Scheduler)
                continue
            if not resolves(ref):
                missing.append(f"{page_name(page)}: {ref}")
    assert not missing, "\n".join(missing)


def resolves(dotted: str) -> bool:
    """Whether ``dotted`` is a module, or an attribute chain under the longest module prefix of it."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def test_the_architecture_page_names_every_layer_of_the_import_contract():
    """docs/architecture.md's layer table follows pyproject.toml's [tool.importlinter] layers contract."""
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    page = (ROOT / "docs" / "architecture.md").read_text()
    for layer in layers:
        for name in (n.strip() for n in layer.replace("|", ":").split(":")):
            assert re.search(rf"`(dualpath\.)?{name}`", page), f"docs/architecture.md does not name the layer {name}"
