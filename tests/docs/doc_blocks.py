"""The code blocks of README.md and docs/*.md, as the tests run them.

A fenced block's language says what it is: ``python`` and ``bash`` blocks run, ``text``, ``json`` and ``yaml``
blocks are shown only. An HTML comment on the line before a fence (invisible on GitHub and in the site) changes how
a block runs:

- ``<!-- doc-test: skip (why) -->``: never run here (GPUs, Slurm, Kubernetes, installs, a server that keeps
  running); its ``dualpath`` command lines are still parsed by the CLI's own parser, and its Python compiled;
- ``<!-- doc-test: slow (why) -->``: run in the slow tier only (``pytest -m slow``);
- ``<!-- doc-test: server ARGS -->``: run against a ``dualpath serve ARGS`` of its own (slow tier too).

Blocks of one page run top to bottom, its Python blocks in one namespace, as a reader would run them. A block that
names ``127.0.0.1:8000`` (the documented default address) or runs ``dualpath status`` gets a real ``dualpath serve``
of the default model, shared by every block that needs one; the address is rewritten to the server's own port, and
``curl`` is given ``-f`` so that an HTTP error fails the block.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from serve_process import ServeProcess

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
ADDRESS = "127.0.0.1:8000"
RUNS = ("python", "bash")
SHOWN = ("text", "json", "yaml")
MARK = re.compile(r"<!--\s*doc-test:\s*(?P<kind>skip|slow|server)\b(?P<rest>.*?)-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)


@dataclass
class Block:
    page: str
    line: int
    lang: str
    code: str
    kind: str = ""  # "", "skip", "slow" or "server"
    note: str = ""  # skip/slow: why; server: the serve arguments
    server_args: tuple[str, ...] = field(default=())

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def needs_server(self) -> bool:
        return ADDRESS in self.code or bool(re.search(r"^\s*dualpath status\b", self.code, re.M))

    def slow(self) -> bool:
        return self.kind == "slow" or (self.kind == "server" and bool(self.server_args))

    def runs(self) -> bool:
        return self.lang in RUNS and self.kind != "skip"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def page_name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        start = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        indent = m.group("indent")
        body = "\n".join(ln[len(indent) :] if ln.startswith(indent) else ln for ln in m.group("body").split("\n"))
        b = Block(page_name(path), start, m.group("lang"), body)
        mark = MARK.search(before)
        if mark:
            b.kind, b.note = mark.group("kind"), mark.group("rest").strip()
            if b.kind == "server":
                b.server_args = tuple(shlex.split(b.note))
        out.append(b)
    return out


def marks_without_blocks(path: Path) -> list[str]:
    """Markers that are not on the line right before a fence (so they would mark nothing)."""
    lines = path.read_text().split("\n")
    bad = []
    for i, ln in enumerate(lines):
        if "doc-test" in ln and not (i + 1 < len(lines) and lines[i + 1].lstrip().startswith("```")):
            bad.append(f"{page_name(path)}:{i + 1}: {ln.strip()}")
        elif "doc-test" in ln and not MARK.search(ln):
            bad.append(f"{page_name(path)}:{i + 1}: not a doc-test marker: {ln.strip()}")
    return bad


# --- the dualpath command lines of bash blocks ------------------------------------------------------------------


def commands(code: str) -> list[list[str]]:
    """Every ``dualpath ...`` command line in a bash block, as argv (without "dualpath"): continuations joined,
    comments dropped, split at ``&&``, ``||``, ``;`` and pipes, leading ``VAR=value`` assignments skipped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.split("\n"):
        if "dualpath" not in line:
            continue
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue
        part: list[str] = []
        for w in [*words, ";"]:
            if w in ("&&", "||", ";", "|"):
                while part and re.match(r"^[A-Z_][A-Z0-9_]*=", part[0]):
                    part.pop(0)
                if part and part[0] == "dualpath":
                    out.append(part[1:])
                part = []
            else:
                part.append(w)
    return out


def parse_error(argv: list[str]) -> str:
    """What the CLI's parser says of ``dualpath argv`` ("" when it takes it)."""
    from dualpath.cli import build_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv)
    except SystemExit as e:
        return err.getvalue().strip() or f"exit {e.code}"
    return ""


# --- paths and modules the prose names ---------------------------------------------------------------------------

PATH_REF = re.compile(r"`((?:dualpath|engines|traffic|scheduler|kernels|bench|tests|deploy|docs)/[\w./*<>-]*)")
MODULE_REF = re.compile(r"`(dualpath(?:\.\w+)+)")


def path_refs(text: str) -> set[str]:
    """Repository paths in backticks (globs and placeholders such as ``kernels/triton_*.py`` left out)."""
    return {m.group(1).rstrip(".") for m in PATH_REF.finditer(text) if not re.search(r"[*<>]", m.group(1))}


def module_refs(text: str) -> set[str]:
    return {m.group(1) for m in MODULE_REF.finditer(text)}


# --- running them ----------------------------------------------------------------------------------------------


class DocServers:
    """``dualpath serve`` processes by their arguments, under a cache directory of their own
    (``DUALPATH_CACHE_DIR``: their KV store and their run records, so ``dualpath status`` finds them and nothing
    else), whose ``models`` is the user's converted default model."""

    def __init__(self, cache: Path, models: Path):
        self.cache = cache
        (cache / "models").symlink_to(models, target_is_directory=True)
        self.servers: dict[tuple[str, ...], ServeProcess] = {}

    def env(self) -> dict[str, str]:
        return {**os.environ, "DUALPATH_CACHE_DIR": str(self.cache)}

    def get(self, args: tuple[str, ...] = ()) -> ServeProcess:
        if args not in self.servers:
            old = os.environ.get("DUALPATH_CACHE_DIR")
            os.environ["DUALPATH_CACHE_DIR"] = str(self.cache)
            try:
                self.servers[args] = ServeProcess("--torch-threads", "1", *args)
            finally:
                if old is None:
                    del os.environ["DUALPATH_CACHE_DIR"]
                else:
                    os.environ["DUALPATH_CACHE_DIR"] = old
        return self.servers[args]

    def stop(self) -> list[str]:
        failed = []
        for args, server in self.servers.items():
            if server.stop() != 0:
                failed.append(f"dualpath serve {' '.join(args)}:\n{server.log_tail()}")
        return failed


def run_blocks(blocks: list[Block], servers: DocServers, workdir: Path) -> None:
    """Run ``blocks`` (one page's, in order) as ``doc_blocks`` describes; fail naming the block that failed."""
    namespace: dict = {"__name__": "__doc__"}
    for b in blocks:
        code = b.code
        if b.needs_server():
            server = servers.get(b.server_args)
            code = code.replace(ADDRESS, f"127.0.0.1:{server.port}")
        started = time.monotonic()
        if b.lang == "python":
            cwd = os.getcwd()
            os.chdir(workdir)
            try:
                exec(compile(code, b.where, "exec"), namespace)
            except Exception as e:
                raise AssertionError(f"{b.where}: the Python block failed: {e!r}") from e
            finally:
                os.chdir(cwd)
        elif b.lang == "bash":
            code = re.sub(r"\bcurl ", "curl -f ", code)
            done = subprocess.run(
                ["bash", "-euo", "pipefail", "-c", code],
                cwd=workdir,
                env=servers.env(),
                capture_output=True,
                text=True,
                timeout=600,
            )
            print(done.stdout)
            assert done.returncode == 0, (
                f"{b.where}: the bash block exited {done.returncode}:\n{code}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
            )
        print(f"{b.where}: {b.lang} block ran in {time.monotonic() - started:.1f} s")
