"""docs/performance.md's tables are what bench/results/*.json hold: the page's generated part equals what
docs/gen_performance.py writes from them, so a rerun benchmark cannot leave a stale number behind."""

import importlib.util

from doc_blocks import DOCS


def generator():
    spec = importlib.util.spec_from_file_location("gen_performance", DOCS / "gen_performance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_performance_page_is_what_the_results_give():
    gen = generator()
    text = gen.PAGE.read_text()
    assert text.count(gen.BEGIN) == 1 and text.count(gen.END) == 1
    assert gen.page(text) == text, "docs/performance.md is out of date: run python docs/gen_performance.py"


def test_every_result_the_page_names_exists():
    gen = generator()
    for section in gen.SECTIONS:
        assert "Source: `bench/results/" in section(), section.__name__
