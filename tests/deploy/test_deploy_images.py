"""The container recipes, checked without a Docker daemon: what they copy exists, the extras they install are the
project's, torch comes before the project (so pip never swaps the build), the default command is one the CLI
accepts, and the processes run as an unprivileged user (a fixed uid the Helm chart names) who owns the caches the
runtime writes, with nothing world-writable left in the image."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from dualpath.cli import build_parser  # noqa: E402 - after the skip

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "deploy/docker").glob("Dockerfile*"))


def instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1].strip())
        for line in text.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


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
    for group in re.findall(r"\.\[([a-z,]+)\]", runs[project_at]):
        assert set(group.split(",")) <= set(extras), group
    assert any("convert-default-model" in r for r in runs)
    cmd = json.loads(next(arg for op, arg in steps if op == "CMD"))
    assert cmd[0] == "dualpath"
    build_parser().parse_args(cmd[1:])
    if path.name == "Dockerfile":
        assert "gpu" in runs[project_at] and "ucx" in runs[project_at] and "nixl" in runs[project_at]
        assert any("python3-pyverbs" in r and "rdma-core" in r for r in runs)
        assert any("--system-site-packages" in r for r in runs)


def env_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    """The image's ENV settings (KEY=VALUE forms, as these recipes write them)."""
    env = {}
    for op, arg in steps:
        if op == "ENV":
            env.update(item.split("=", 1) for item in arg.split())
    return env


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_the_image_runs_as_an_unprivileged_user(path):
    steps = instructions(path)
    users = [(i, arg) for i, (op, arg) in enumerate(steps) if op == "USER"]
    assert users, f"{path.name}: no USER: the container would run as root"
    last_at, last = users[-1]
    uid, _, gid = last.partition(":")
    assert uid.isdigit() and int(uid) != 0 and gid.isdigit() and int(gid) != 0, last  # numeric: runAsNonRoot checks
    assert uid == gid == "1000"  # what the chart's securityContext.runAsUser / fsGroup default to
    assert all(op not in ("RUN", "USER") for op, _ in steps[last_at + 1 :]), "nothing runs as root after the switch"
    runs = " ".join(arg for op, arg in steps[:last_at] if op == "RUN")
    assert f"useradd --uid {uid} --gid {gid}" in runs and f"groupadd --gid {gid}" in runs
    env = env_of(steps)
    home = env["HOME"]
    assert f"--home-dir {home}" in runs and f"chown -R {uid}:{gid} {home}" in runs  # its caches are its own
    for cache in ("XDG_CACHE_HOME", "HF_HOME", "TRITON_CACHE_DIR"):  # one writable directory (the chart's emptyDir)
        assert env[cache].startswith(f"{home}/.cache"), (cache, env[cache])
    # the built-in model readable by the user, the cache directory (its default KV store) the user's
    assert 'chmod -R a+rX,go-w "$DUALPATH_CACHE_DIR"' in runs and f'chown {uid}:{gid} "$DUALPATH_CACHE_DIR"' in runs
    # nothing world-writable but sticky scratch directories (/tmp), after every step that adds files as root
    scrub = next(i for i, (op, arg) in enumerate(steps) if op == "RUN" and "-perm -0002" in arg)
    assert "! -perm -1000 -exec chmod o-w" in steps[scrub][1]
    assert all(op != "COPY" and not (op == "RUN" and "install" in arg) for op, arg in steps[scrub + 1 :])
    assert dict(steps[last_at:]).get("WORKDIR") == home  # its working directory is its own, not the sources'
