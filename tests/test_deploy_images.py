"""The container recipes, checked without a Docker daemon: what they copy exists, the extras they install are the
project's, torch comes before the project (so pip never swaps the build), and the default command is one the CLI
accepts."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from dualpath.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "deploy/docker").glob("Dockerfile*"))


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
            for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_there_is_a_gpu_and_a_cpu_image():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile", "Dockerfile.cpu"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_is_consistent_with_the_project(path):
    steps = instructions(path)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for op, arg in steps:
        if op == "COPY":
            *sources, _ = arg.split()
            for s in sources:
                assert (ROOT / s).exists(), f"{path.name}: COPY {s} does not exist"
    runs = [arg for op, arg in steps if op == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "pip install" in r and "torch" in r)
    project_at = next(i for i, r in enumerate(runs) if re.search(r'pip install "?\.\[', r))
    assert torch_at < project_at
    for group in re.findall(r'\.\[([a-z,]+)\]', runs[project_at]):
        assert set(group.split(",")) <= set(extras), group
    assert any("convert-default-model" in r for r in runs)
    cmd = json.loads(next(arg for op, arg in steps if op == "CMD"))
    assert cmd[0] == "dualpath"
    build_parser().parse_args(cmd[1:])
    if path.name == "Dockerfile":
        assert "gpu" in runs[project_at] and "ucx" in runs[project_at] and "nixl" in runs[project_at]
        assert any("python3-pyverbs" in r and "rdma-core" in r for r in runs)
        assert any("--system-site-packages" in r for r in runs)
