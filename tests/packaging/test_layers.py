"""The package as installed: one namespace, its package list whole, and the layers' import contract (import-linter,
configured in ``pyproject.toml``) kept, imports inside functions included."""

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def source_dir(package: str) -> Path:
    """Where ``package``'s files are in the repository (the longest ``package-dir`` prefix)."""
    parts = package.split(".")
    for i in range(len(parts), 0, -1):
        mapped = SETUPTOOLS["package-dir"].get(".".join(parts[:i]))
        if mapped is not None:
            return ROOT / mapped / Path(*parts[i:])
    raise AssertionError(f"{package} has no package-dir entry")


def installed_layout(out: Path) -> Path:
    """The packages' modules copied as a wheel lays them out (``dualpath/engines/...``); returns ``out``."""
    for package in SETUPTOOLS["packages"]:
        dst = out / Path(*package.split("."))
        dst.mkdir(parents=True, exist_ok=True)
        for f in source_dir(package).glob("*.py"):
            shutil.copy2(f, dst / f.name)
    return out


def test_every_package_in_the_tree_is_installed_under_dualpath():
    """Each directory with an ``__init__.py`` under a mapped folder is a listed package (a new subpackage that is
    not listed would be missing from wheels), and nothing is installed outside ``dualpath``."""
    listed = set(SETUPTOOLS["packages"])
    assert all(p == "dualpath" or p.startswith("dualpath.") for p in listed)
    found = set()
    for package, folder in SETUPTOOLS["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *rel)))
    assert found == listed


LINT = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_the_import_contract_is_kept(tmp_path):
    """import-linter over the installed layout: product > scheduler | engines > traffic | kernels > core, and no
    cycle among any package's modules. A lower layer importing a higher one (even inside a function) fails here."""
    pytest.importorskip("importlinter")
    pkg = installed_layout(tmp_path / "pkg")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pkg), "HOME": str(tmp_path)}
    r = subprocess.run(
        [sys.executable, "-c", LINT, str(ROOT / "pyproject.toml")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "2 kept, 0 broken" in r.stdout


def test_importing_dualpath_loads_no_engine():
    """``import dualpath`` (and its core) stays cheap: neither torch-heavy engines nor the HTTP stack load until
    ``LLM`` is asked for."""
    code = (
        "import sys, dualpath, dualpath.core.config, dualpath.core.messages; "
        "print(sorted(m for m in sys.modules if m.startswith(('dualpath.engines', 'dualpath.serving', 'fastapi'))))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
