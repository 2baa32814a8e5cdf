"""A mutation score for the scheduler's policy and the load signals it places requests by (issue 55, item 7).

mutmut 3 (``pip install mutmut==3.8.1``) mutates the functions of ``SCOPE`` one change at a time (an operator, a
constant, a comparison, a call's argument...) and runs, for each mutant, the tests of ``TESTS`` that call the
mutated function (it records which do in a first run). A mutant is killed when one of them fails, survives when all
pass. The score is killed / (mutants - those listed in ``EQUIVALENT``, which no test can kill: they compute the same
thing); the result lists every survivor, each with its reason when it is equivalent.

The run happens in a copy of the repository (``--work``, outside it: ruff and pytest never see the mutants), laid
out as ``src/dualpath/...``: mutmut names a mutant after its file's path and switches it on by comparing that name
with the module the function was imported as, so the package-dir mapping of pyproject.toml (``scheduler/`` ->
``dualpath.scheduler``) must be a real directory tree there. The mutated copies are what the tests import (mutmut
puts ``mutants/src`` first on ``sys.path``; ``--check`` shows it by planting a bug). Nothing is installed and the
repository is not touched, but for ``--out``.

    python bench/mutation.py [--work /tmp/dualpath-mutation] [--max-children 1] [--out bench/results/mutation.json]
    python bench/mutation.py --only 'dualpath.scheduler.paper.*'   # a part, while writing tests (no --out)

Takes ~N minutes on two busy cores (``nice``d, one child)."""

from __future__ import annotations

import argparse
import ast
import difflib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, print_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MUTMUT = "3.8.1"
SEP = "ǁ"  # mutmut's separator in a method's mangled name: xǁClassǁmethod

# pyproject's [tool.setuptools.package-dir], as one tree under src/ in the work copy
LAYOUT = {
    "dualpath": "dualpath",
    "dualpath/engines": "engines",
    "dualpath/traffic": "traffic",
    "dualpath/scheduler": "scheduler",
    "dualpath/kernels": "kernels",
}


@dataclass
class Part:
    """The functions of one file in scope: ``only`` (qualified names, ``Class.method``; empty: every function) less
    ``skip`` (name -> why it is left out)."""

    path: str  # under src/
    only: list[str] = field(default_factory=list)
    skip: dict[str, str] = field(default_factory=dict)
    why: str = ""

    @property
    def module(self) -> str:
        return self.path[: -len(".py")].replace("/", ".")


SCOPE = [
    Part("dualpath/scheduler/policy.py", why="the policy interface, path choice, recompute and preemption rules"),
    Part("dualpath/scheduler/paper.py", why="the paper's Algorithm 1 and decode phases"),
    Part("dualpath/scheduler/baselines.py", why="least-loaded, round-robin, random"),
    Part("dualpath/scheduler/balance.py", why="windowed read and busy sums, max/avg, measured alpha"),
    Part("dualpath/scheduler/index.py", why="the block index: which prompt blocks are stored (the hit length)"),
    Part(
        "dualpath/scheduler/core.py",
        only=[
            "Outstanding.__init__",
            "Outstanding.add",
            "Outstanding.discard",
            "Outstanding.discard_all",
            "Outstanding.__len__",
            "EngineRecord.measured_beta",
            "SchedulerCore._index_reports",
            "SchedulerCore._alive",
            "SchedulerCore._absorb",
            "SchedulerCore._state",
            "SchedulerCore._group_totals",
            "SchedulerCore.node_state",
            "SchedulerCore.live_alpha",
            "_Nodes.__missing__",
            "_Nodes.get",
            "_Nodes.setdefault",
        ],
        why="the load aggregation: reports absorbed, work handed out since, engine and node states, live alpha",
    ),
    Part("dualpath/engines/engine.py", only=["Engine.load", "Engine._delivered"], why="an engine's load report"),
    Part("dualpath/engines/prefill.py", only=["PrefillEngine.held", "PrefillEngine.beta_tokens"], why="prefill load"),
    Part(
        "dualpath/engines/decode.py",
        only=["DecodeEngine.held", "DecodeEngine.free_tokens", "Held.tokens"],
        why="decode load",
    ),
    Part("dualpath/engines/sampler.py", why="next-token choice: adjustments, filters, draws, logprobs"),
    Part(
        "dualpath/traffic/transport/base.py",
        skip={
            "Transport.__enter__": "context-manager plumbing",
            "Transport.__exit__": "context-manager plumbing",
        },
        why="the transport contract: validation, lanes, pieces, the priority gate",
    ),
    Part("dualpath/core/geometry.py", why="KV block geometry and block identity"),
]

TEST_TIMEOUT_S = 15  # the slowest test of TESTS takes ~3 s on two busy cores

# Lines never mutated (regular expressions; a match leaves the whole expression starting on that line alone)
DO_NOT_MUTATE = [
    r"^\s*log\.(debug|info|warning|error|exception)\(",  # what is logged
    r"^\s*raise \w+\(",  # the text (and field) of an error raised: the condition that raises is mutated
]

# The fast tests (pure, in-process, no clusters) that cover the scope
TESTS = [
    "tests/scheduler/test_policy.py",
    "tests/scheduler/test_policy_boundaries.py",
    "tests/scheduler/test_scheduler_core.py",
    "tests/scheduler/test_block_index.py",
    "tests/engines/test_sampling.py",
    "tests/engines/test_sampling_distributions.py",
    "tests/engines/test_penalties.py",
    "tests/engines/test_guided.py::test_sampling_takes_only_allowed_tokens_and_leaves_other_rows_alone",
    "tests/engines/test_guided.py::test_bitmask_rows_sample_as_their_boolean_masks",
    "tests/core/test_geometry.py",
    "tests/engines/test_load_report_mutants.py",
    "tests/core/test_geometry_mutants.py",
    "tests/scheduler/test_index_mutants.py",
    "tests/scheduler/test_policy_mutants.py",
    "tests/scheduler/test_signal_mutants.py",
    "tests/traffic/test_transport_mutants.py",
    "tests/engines/test_sampler_mutants.py",
    "tests/traffic/test_priority_gate.py",
    *(
        f"tests/traffic/test_transport_contract.py::{t}[local]"
        for t in (
            "test_read_batch_lands_byte_exact",
            "test_write_batch_lands_byte_exact",
            "test_large_segments_are_chunked_and_exact",
            "test_bad_segments_raise_at_submit",
            "test_dead_peer_errors_within_timeout",
            "test_high_priority_overtakes_bulk_low_priority",
        )
    ),
]

# Survivors no test can kill, by function and the mutated line (mutant numbers move when a function changes):
# (qualified name, the line as mutated, stripped) -> why the mutant computes the same thing
_RR_KEY = (
    "the turn's key only has to differ from the other turns' ('group', 'decode', 'prefill', 'path'); so does this one"
)
_POP = "every request placed was drawn by this pick or an earlier one, so its key is there: pop never needs the default"
EQUIVALENT: dict[tuple[str, str], str] = {
    ("blocks_to_load", "if hit_blocks < 0 or alpha <= 0 or beta <= 0:"): "with no hit block (0) both the early return "
    "and the rule's answer (0 or hit_blocks) are 0",
    ("split_path", "hit_blocks = r.num_hit_tokens / block_size"): "num_hit_tokens is whole blocks (the scheduler "
    "passes hit_blocks x block_size), so / gives the same count, as a float equal to it; pe_blocks stays an int",
    **{
        (
            "RoundRobinPolicy.assign_decode",
            f"pick = self._picker({k}, pulling, lambda r, e: e.free_tokens >= r.reserve_tokens)",
        ): _RR_KEY
        for k in ("None", '"XXdecodeXX"', '"DECODE"')
    },
    **{
        ("RoundRobinPolicy.assign_prefill", f"self._picker({k}, pulling, lambda r, e: True),"): _RR_KEY
        for k in ("None", '"XXprefillXX"', '"PREFILL"')
    },
    ("RoundRobinPolicy.dualpath_path", 'self._next["path"] = self._next.get("path", 0) ^ 2'): "the flag alternates "
    "between 0 and 2 instead of 0 and 1: the same truth values, the same paths",
    ("RandomPolicy.assign_decode", 'self._drawn.pop(("decode", r.request_id), )'): _POP,
    ("RandomPolicy.assign_prefill", 'self._drawn.pop(("prefill", d.request_id), )'): _POP,
    ("BlockIndex._place", "left[won] = None"): "numpy stores None in a bool array as False",
    ("BlockIndex._place", "taken = None"): "after a round every id left sits on an occupied slot (it was taken, or "
    "the round's winner took it), so advancing all of them (pos[None]) is advancing the taken ones",
    ("BlockIndex._place", "if len(ids) < _FEW:"): "48 ids go through numpy rounds instead of the Python loop: both put "
    "each id on the first empty slot its probe reaches; only the speed differs",
    ("BlockIndex.add_packed", "if len(packed) < _FEW * HASH_BYTES:"): "48 hashes take the numpy path instead of the "
    "Python one: the same ids added; only the speed differs",
    ("BlockIndex.add_packed", "if len(packed) <= _FEW / HASH_BYTES:"): "only up to 3 hashes take the Python path, "
    "more the numpy one: the same ids added; only the speed differs",
    ("HeadShard.__post_init__", "if not 0 <= self.rank < s or (n % s if n > s else s % n):"): "at n == s both "
    "n % s and s % n are 0",
    ("HeadShard.first", "if self.num_kv_heads > self.size:"): "at num_kv_heads == size: rank x 1 == rank // 1",
    (
        "HeadShard.primary",
        "return self.num_kv_heads > self.size or self.rank % (self.size // self.num_kv_heads) == 0",
    ): "at num_kv_heads == size: rank % 1 == 0, primary either way",
    (
        "HeadShard.primary",
        "return self.num_kv_heads >= self.size or self.rank % (self.size / self.num_kv_heads) == 0",
    ): "size is a multiple of num_kv_heads (checked at construction): the float quotient is exact, the "
    "remainder the same",
}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", 34: "skipped", 36: "timeout"}
STATUS.update({-24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", -11: "crashed", -9: "crashed"})

# pytest plugin (in the work copy): tests that load a model (the tiny checkpoints, transformers) are left out: seconds
# each, for every mutant of the sampler they call; the sampler's unit tests and the new ones cover its logic
MODEL_FIXTURES = ("tiny_dirs", "tiny_adapters", "smollm2_dir", "llm", "hf")
PLUGIN = f"""
MODEL_FIXTURES = {MODEL_FIXTURES!r}


def pytest_collection_modifyitems(session, config, items):
    model = [item for item in items if set(getattr(item, "fixturenames", ())) & set(MODEL_FIXTURES)]
    if model:
        config.hook.pytest_deselected(items=model)
        items[:] = [item for item in items if item not in model]
"""


PROPERTY = "_property_"  # a property's getter, renamed in the work copy so that mutmut mutates it


def unwrap_properties(text: str) -> str:
    """Rewrite the plain ``@property`` getters of ``path``'s top-level classes as ``name = property(_property_name)``
    after a method ``_property_name``: the same class, and mutmut (which mutates no decorated function) mutates the
    getter. Line numbers stay as they were (the decorator's line gives way to the assignment's)."""
    lines = text.split("\n")
    edits = []
    for cls in ast.parse("\n".join(lines)).body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for f in cls.body:
            if isinstance(f, ast.FunctionDef) and [ast.dump(d) for d in f.decorator_list] == [
                ast.dump(ast.Name("property", ast.Load()))
            ]:
                edits.append((f.decorator_list[0].lineno, f.lineno, f.end_lineno, f.name))
    for deco, start, end, name in sorted(edits, reverse=True):
        indent = lines[deco - 1][: len(lines[deco - 1]) - len(lines[deco - 1].lstrip())]
        lines.insert(end, f"{indent}{name} = property({PROPERTY}{name})")
        lines[start - 1] = lines[start - 1].replace(f"def {name}(", f"def {PROPERTY}{name}(", 1)
        del lines[deco - 1]
    return "\n".join(lines)


def qualnames(path: Path) -> dict[str, bool]:
    """Every function mutmut may mutate in ``path`` (top-level functions, methods of top-level classes) ->
    whether it does (mutmut leaves decorated ones, but for static and class methods, alone)."""
    out = {}
    for node in ast.parse(path.read_text()).body:
        defs = [(node, "")] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
        if isinstance(node, ast.ClassDef):
            defs = [(f, node.name + ".") for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for f, prefix in defs:
            names = [d.id for d in f.decorator_list if isinstance(d, ast.Name)]
            out[prefix + f.name] = not f.decorator_list or (
                len(f.decorator_list) == 1 and names in (["staticmethod"], ["classmethod"])
            )
    return out


def mangled(qualname: str) -> str:
    cls, _, name = qualname.rpartition(".")
    return f"x{SEP}{cls}{SEP}{name}" if cls else f"x_{name}"


def unmangled(key: str) -> str:
    """``xǁClassǁmethod`` or ``x_function`` (a mutant's function part) -> ``Class.method`` or ``function``."""
    if key.startswith("x" + SEP):
        cls, name = key[2:].split(SEP)
        return f"{cls}.{name.removeprefix(PROPERTY)}"
    return key[2:]


def scope_report(src: Path) -> tuple[list[str], dict]:
    """(mutmut's name globs for the functions in scope, the scope as the result states it)."""
    globs, report = [], {}
    for part in SCOPE:
        funcs = qualnames(src / part.path)
        getter = {n.replace(PROPERTY, ""): n for n in funcs if f".{PROPERTY}" in n}
        chosen = [getter.get(f, f) for f in part.only] or list(funcs)
        missing = [f for f in chosen if f not in funcs]
        assert not missing, f"{part.path} has no {missing}"
        mutated = [f for f in chosen if funcs[f] and f not in part.skip]
        globs += [f"{part.module}.{mangled(f)}__mutmut_*" for f in mutated]
        report[part.module] = {
            "why": part.why,
            "functions": [unmangled(mangled(f)) for f in mutated],
            "left_out": {
                **part.skip,
                **{f: "abstract: no body" for f in chosen if not funcs[f]},
                **({"(others)": "not policy or signal logic"} if part.only else {}),
            },
        }
    return globs, report


def prepare(work: Path, fresh: bool, tests: list[str]) -> None:
    """The work copy: the repository's tracked and new files, the package laid out under src/, mutmut's config."""
    if fresh and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\n")
    src = work / "src"
    scope = {part.path for part in SCOPE}
    for name in filter(None, files):
        path = ROOT / name
        if not path.is_file():
            continue
        top, _, rest = name.partition("/")
        if top in ("src", "mutants"):  # (the layout this builds, or a run's output, left in a checkout)
            continue
        package = next((pkg for pkg, d in LAYOUT.items() if d == top), None)
        targets = [(work / name, path.read_bytes())]
        if package is not None:
            text = path.read_bytes()
            if f"{package}/{rest}" in scope:
                text = unwrap_properties(text.decode()).encode()
            targets.append((src / package / rest, text))
        for target, text in targets:
            if not target.exists() or target.read_bytes() != text:  # unchanged files keep mutmut's results
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(text)
    # which tests call which function is recorded anew: mutmut re-records it only for new tests, not for functions
    # that changed (a renamed one would have none, its mutants "no tests")
    (work / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)
    plugin = src / "_mutation_plugin.py"
    if not plugin.exists() or plugin.read_text() != PLUGIN:
        plugin.write_text(PLUGIN)
    pyproject = (ROOT / "pyproject.toml").read_text()
    pyproject = re.sub(r"(?ms)^\[tool\.mutmut\].*?(?=^\[|\Z)", "", pyproject)  # ours replaces any
    config = {
        "source_paths": ["src"],
        "only_mutate": [f"src/{p.path}" for p in SCOPE],
        "do_not_mutate_patterns": DO_NOT_MUTATE,
        "pytest_add_cli_args_test_selection": tests,
        # a test a mutant keeps running past TEST_TIMEOUT_S fails (pytest-timeout): a hang costs that, not mutmut's
        # own limit, which stays generous (15 x the tests' time) so that a busy machine never fakes a timeout
        "pytest_add_cli_args": ["-p", "_mutation_plugin", "-p", "no:cacheprovider", f"--timeout={TEST_TIMEOUT_S}"],
        "use_git_change_detection": False,
        "timeout_multiplier": 15.0,
    }
    lines = ["", "[tool.mutmut]"] + [f"{k} = {json.dumps(v, ensure_ascii=False)}" for k, v in config.items()]
    (work / "pyproject.toml").write_text(pyproject + "\n".join(lines) + "\n")


def check_mutmut(python: str) -> None:
    found = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('mutmut'))"], capture_output=True, text=True
    ).stdout.strip()
    if not found:
        sys.exit(f"mutmut is not installed for {python}: pip install mutmut=={MUTMUT}")
    if found != MUTMUT:
        print(f"warning: mutmut {found}, not {MUTMUT}: its mutants (and EQUIVALENT's lines) may differ")


def run_mutmut(work: Path, globs: list[str], max_children: int, python: str) -> float:
    # one intra-op thread: mutmut forks a child per mutant from a process that has run torch, and a forked child
    # whose parent had started OpenMP's threads hangs in its first parallel op (a "timeout" that is no kill)
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t = time.monotonic()
    cmd = ["nice", "-n", "10", python, "-m", "mutmut", "run", "--max-children", str(max_children), *globs]
    subprocess.run(cmd, cwd=work, env=env, check=False)
    return time.monotonic() - t


def imported_from(work: Path, python: str) -> str:
    """Where the tests' ``dualpath.scheduler.policy`` comes from, with mutmut's path set-up: the mutated copy."""
    code = "import dualpath.scheduler.policy as p; print(p.__file__)"
    env = {**os.environ, "PYTHONSAFEPATH": "1", "PYTHONPATH": str(work / "mutants" / "src"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([python, "-c", code], cwd=work / "mutants", env=env, capture_output=True, text=True)
    return str(Path(out.stdout.strip()).relative_to(work)) if out.returncode == 0 else out.stderr[-300:]


@functools.cache
def _mutated_file(work: Path, part_path: str) -> tuple[dict, list[str]]:
    spans = json.loads((work / "mutants" / "src" / (part_path + ".spans")).read_text())["spans"]
    return spans, (work / "mutants" / "src" / part_path).read_text().splitlines()


def function_source(work: Path, part_path: str, name: str) -> list[str]:
    """A generated function's lines in the mutated file (``name``: e.g. ``xǁClassǁm__mutmut_3``)."""
    spans, lines = _mutated_file(work, part_path)
    start, end = spans[name]
    return lines[start - 1 : end]


def mutated_line(work: Path, part_path: str, key: str) -> str:
    """The line a mutant changes, as changed (stripped; joined by ' / ' when it changes several)."""
    orig_key = key.partition("__mutmut_")[0] + "__mutmut_orig"
    mutant = [line.replace(key + "(", orig_key + "(") for line in function_source(work, part_path, key)]
    orig = function_source(work, part_path, orig_key)
    changed = [line[2:].strip() for line in difflib.ndiff(orig, mutant) if line.startswith("+ ")]
    return " / ".join(changed) or "(a line removed)"


def collect(work: Path, report: dict) -> tuple[dict, list[dict]]:
    """Per module (killed, survived, ...) of the mutants in scope, and every survivor."""
    modules, survivors = {}, []
    in_scope = {m: set(r["functions"]) for m, r in report.items()}
    for part in SCOPE:
        meta = json.loads((work / "mutants" / "src" / (part.path + ".meta")).read_text())
        counts = {"total": 0, "killed": 0, "survived": 0, "timeout": 0, "equivalent": 0, "other": 0}
        for key, code in sorted(meta["exit_code_by_key"].items()):
            func_key = key[len(part.module) + 1 :].partition("__mutmut_")[0]
            if unmangled(func_key) not in in_scope[part.module]:
                continue
            status = STATUS.get(code, "not checked" if code is None else "suspicious")
            counts["total"] += 1
            if status in ("killed", "survived", "timeout"):
                counts[status] += 1
            else:
                counts["other"] += 1
            if status not in ("killed", "timeout"):
                name = unmangled(func_key)
                line = mutated_line(work, part.path, key[len(part.module) + 1 :])
                reason = EQUIVALENT.get((name, line))
                counts["equivalent"] += reason is not None and status == "survived"
                survivors.append(
                    {"mutant": key, "function": name, "status": status, "mutated": line, "equivalent": reason}
                )
        detectable = counts["total"] - counts["equivalent"]
        counts["score"] = round((counts["killed"] + counts["timeout"]) / detectable, 4) if detectable else 1.0
        modules[part.module] = counts
    return modules, survivors


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/dualpath-mutation", help="the work copy (outside the repository)")
    ap.add_argument("--max-children", type=int, default=1)
    ap.add_argument("--fresh", action="store_true", help="start from an empty work copy (no cached results)")
    ap.add_argument("--only", nargs="*", help="mutant name globs (a part of the scope; writes no result)")
    ap.add_argument("--tests", nargs="*", help="these tests instead of TESTS (with --only)")
    ap.add_argument("--report-only", action="store_true", help="collect the work copy's last results, run nothing")
    ap.add_argument("--python", default=sys.executable, help="a Python with mutmut and the test dependencies")
    ap.add_argument("--out", default=str(RESULTS / "mutation.json"))
    args = ap.parse_args()
    work = Path(args.work).resolve()
    assert ROOT not in work.parents and work != ROOT, "the work copy must be outside the repository"
    if not args.report_only:
        assert args.only or not args.tests, "--tests goes with --only"
        check_mutmut(args.python)
        prepare(work, args.fresh, args.tests or TESTS)
    globs, report = scope_report(work / "src")
    seconds = None
    if not args.report_only:
        seconds = run_mutmut(work, args.only or globs, args.max_children, args.python)
    modules, survivors = collect(work, report)
    rows = [{"module": m, **c} for m, c in modules.items()]
    total = {
        k: sum(c[k] for c in modules.values())
        for k in ("total", "killed", "survived", "timeout", "equivalent", "other")
    }
    detectable = total["total"] - total["equivalent"]
    total["score"] = round((total["killed"] + total["timeout"]) / detectable, 4) if detectable else 1.0
    print_table(
        rows + [{"module": "all", **total}],
        ["module", "total", "killed", "timeout", "survived", "equivalent", "other", "score"],
    )
    unexplained = [s for s in survivors if not s["equivalent"]]
    for s in unexplained:
        print(f"SURVIVED {s['mutant']} ({s['status']}): {s['mutated']}")
    if args.only:
        return
    result = {
        "benchmark": "mutation",
        "tool": f"mutmut {MUTMUT}",
        "score": total["score"],
        "target": 0.9,
        "overall": total,
        "modules": modules,
        "seconds": seconds,
        "max_children": args.max_children,
        "tests": TESTS,
        "tests_left_out": f"those using a model fixture ({', '.join(MODEL_FIXTURES)}): seconds each per mutant",
        "test_timeout_s": TEST_TIMEOUT_S,
        "imported_from": imported_from(work, args.python),  # the mutated copy, not the repository's file
        "scope": report,
        "not_mutated_lines": DO_NOT_MUTATE,
        "equivalent": [s for s in survivors if s["equivalent"]],
        "unexplained_survivors": unexplained,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
