"""The built wheel in a fresh virtual environment beside the newest transformers (which installs Hugging Face's
``kernels``, an import name this project once collided with): both import, and the parity tests pass against it.
Slow (a venv and its downloads: ~3 minutes); run with ``-m slow``."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = (
    "import kernels, transformers, dualpath.kernels, dualpath.engines.local; "
    "assert 'site-packages/kernels' in kernels.__file__ and 'site-packages/dualpath/kernels' in dualpath.kernels.__file__"
)


def run(*args, cwd=None, timeout=900):
    r = subprocess.run(list(map(str, args)), cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_the_wheel_beside_the_newest_transformers_passes_the_parity_tests(tmp_path):
    run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", tmp_path / "dist", ROOT)
    (wheel,) = (tmp_path / "dist").glob("dualpath-*.whl")
    run(sys.executable, "-m", "venv", tmp_path / "venv")
    py = tmp_path / "venv" / "bin" / "python"
    run(py, "-m", "pip", "install", "-q", "torch==2.13.0")
    run(py, "-m", "pip", "install", "-q", "--upgrade", wheel, "transformers", "pytest", "pytest-timeout", "hypothesis")
    run(py, "-c", CHECK, cwd=tmp_path)
    tests = tmp_path / "t" / "tests"
    shutil.copytree(ROOT / "tests" / "support", tests / "support")
    shutil.copy2(ROOT / "tests" / "conftest.py", tests / "conftest.py")
    (tests / "engines").mkdir()
    shutil.copy2(ROOT / "tests" / "engines" / "test_models_parity.py", tests / "engines")
    (tests.parent / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\nmarkers =\n    slow\n    gpu\n")
    out = run(py, "-m", "pytest", "-q", "-m", "not gpu", "tests/engines/test_models_parity.py", cwd=tests.parent)
    assert " passed" in out and "failed" not in out
