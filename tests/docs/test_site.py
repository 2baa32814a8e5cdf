"""The documentation site builds with ``mkdocs build --strict``: every page in the nav and every page in the nav
there, no link to a missing page or anchor (mkdocs.yml's validation turns those into warnings, --strict into
errors)."""

import os
import subprocess
import sys

import pytest

from doc_blocks import DOCS, ROOT


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")  # the theme: the test extra installs mkdocs-material
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    for page in DOCS.glob("*.md"):
        out = tmp_path / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert out.exists(), f"{page.name} was not built"
