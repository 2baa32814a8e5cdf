"""A mutation score for the scheduler's policy and the load signals it places requests by (issue 55, item 7).

mutmut 3 (``pip install mutmut==3.8.1``) mutates the functions of ``SCOPE`` one change at a time (an operator, a
constant, a comparison, a call's argument...) and runs, for each mutant, the tests of ``TESTS`` that call the
mutated function (it records which do in a first run), fastest first. A mutant is killed when one of them fails
(or runs past ``TEST_TIMEOUT_S``), survives when all pass. The score is killed / (mutants - the survivors
``EQUIVALENT`` explains: they compute the same thing, so no test can tell them apart); the result lists every
survivor, with its reason when it is equivalent.

The run happens in a copy of the repository (``--work``, outside it: ruff and pytest never see the mutants), laid
out as ``src/dualpath/...``: mutmut names a mutant after its file's path and switches it on by comparing that name
with the module the function was imported as, so the package-dir mapping of pyproject.toml (``scheduler/`` ->
``dualpath.scheduler``) must be a real directory tree there. The mutated copies are what the tests import: mutmut
puts ``mutants/src`` first on ``sys.path`` and refuses to go on unless a run with every mutant's trampoline raising
fails (its "forced fail" check); the result records where ``dualpath.scheduler.policy`` is imported from. Nothing is
installed and the repository is not touched, but for ``--out``.

    pip install mutmut==3.8.1
    python bench/mutation.py [--work /tmp/dualpath-mutation] [--max-children 1] [--out bench/results/mutation.json]
    python bench/mutation.py --only 'dualpath.scheduler.paper.*'   # a part, while writing tests (no --out)
    python bench/mutation.py --out /tmp/mutation.json --min-score 0.9   # CI: fails below 0.9 or on a survivor
                                                                         # that EQUIVALENT does not explain

Takes ~66 minutes for the whole scope on two busy cores (``nice``d, one child: 3,960 s on 2026-12-05); ``--only``
reruns a part in minutes, ``--report-only`` collects every verdict the work copy holds."""

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
    rest: str = ""  # with ``only``: what the file's other functions are, and why they are left out

    @property
    def module(self) -> str:
        return self.path[: -len(".py")].replace("/", ".")


SCOPE = [
    Part("dualpath/scheduler/policy.py", why="the policy interface, path choice, recompute and preemption rules"),
    Part("dualpath/scheduler/paper.py", why="the paper's Algorithm 1 and decode phases"),
    Part("dualpath/scheduler/baselines.py", why="least-loaded, round-robin, random"),
    Part("dualpath/scheduler/balance.py", why="windowed read and busy sums, max/avg, measured alpha"),
    Part(
        "dualpath/scheduler/sessions_policy.py",
        why="agent sessions: the tool-gap estimator, when a prefetch is issued, how long it is held",
    ),
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
        rest="request bookkeeping (submission, queues, retries, holds, weight updates, flushes), the engine roster "
        "and the stats/metrics export: not the signals policies place by",
    ),
    Part(
        "dualpath/engines/engine.py",
        only=["Engine.load", "Engine._delivered"],
        why="an engine's load report (and the marks a delivered one moves, which make the next report's deltas)",
        rest="model loading, registration, RPC, the pull loop, weight updates: process plumbing, not signals",
    ),
    Part(
        "dualpath/engines/prefill.py",
        only=["PrefillEngine.held", "PrefillEngine.beta_tokens"],
        why="a prefill engine's load: tokens still to compute, its beta",
        rest="the layerwise prefill, transfers and admission (the engines' own tests)",
    ),
    Part(
        "dualpath/engines/decode.py",
        only=["DecodeEngine.held", "DecodeEngine.free_tokens", "Held.tokens"],
        why="a decode engine's load: held tokens, free KV memory",
        rest="the decode loop, admission and storage writes (the engines' own tests)",
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
    "tests/scheduler/test_sessions.py",
    "tests/scheduler/test_sessions_policy.py",
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
ON_THE_HOST = (
    "on the host (this run is CPU-only) a move to None, to the tensor's own device, blocking or not, is the same "
    "tensor; the GPU runs (bench/gpu) exercise these moves"
)
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
    **{
        (f, line): "shorter_queue and every policy's dualpath_path decide by the nodes alone: the request is not read"
        for f, line in (
            ("Policy.choose_path", "return self.dualpath_path(None, pe_node, de_node)"),
            ("Policy.dualpath_path", "return shorter_queue(None, pe_node, de_node)"),
        )
    },
    (
        "preferred",
        "return next((e for e in pool if e.engine_id == want), None) if (want) or True else None",
    ): "no engine's id is empty: looking for '' finds none",
    **{
        ("Policy.place_prefill", line): "pe_blocks is -1 (one side) or at least 1 (a split): split_path never makes 0"
        for line in (
            "if self.recompute_slow_hits and choice.pe_blocks <= 0 and r.num_hit_tokens:",
            "if self.recompute_slow_hits and choice.pe_blocks < 1 and r.num_hit_tokens:",
        )
    },
    ("Policy.place_prefill", "hit_blocks = r.num_hit_tokens / block_size"): "num_hit_tokens is whole blocks: / gives "
    "the same count, as a float equal to it (blocks_to_load returns 0 or that count)",
    **{
        (
            "DualPathPolicy.assign_prefill",
            f"e = preferred(r, pool, {a}) or min(pool, key=lambda e: (e.tok, e.engine_id))",
        ): (
            "preferred reads sticky and role only on the decode side (role == 'de'): any other role is the prefill side"
        )
        for a in ('None, "pe"', "self.affinity, None", 'self.affinity, "XXpeXX"', 'self.affinity, "PE"')
    },
    ("key_ids", 'words = np.frombuffer(packed, dtype="<u8", )'): "the packed hashes are whole 8-byte words: reading "
    "them all is reading len // 8 of them",
    **{
        ("BlockIndex._find", line): "-1 fills an int64 array without the dtype too"
        for line in ("where = np.full(len(ids), -1, None)", "where = np.full(len(ids), -1, )")
    },
    ("BlockIndex._find", "where = np.full(len(ids), -2, np.int64)"): "callers only test a slot < 0 (missing) or >= 0",
    ("BlockIndex._find_one", "return -2"): "callers only test a slot < 0 (missing) or >= 0",
    ("BlockIndex._find", "if len(ids) < _FEW:"): "48 ids are probed in numpy rounds instead of one by one: the same "
    "slots; only the speed differs",
    **{
        ("BlockIndex.rebuild", line): "decides only whether a progress line is logged"
        for line in (
            "if found / (16 * batch) == 0:",
            "if found % (16 / batch) == 0:",
            "if found % (17 * batch) == 0:",
            "if found % (16 * batch) != 0:",
            "if found % (16 * batch) == 1:",
        )
    },
    # the scheduler core
    **{
        ("Outstanding.discard_all", line): "the list scan and the set intersection discard the same works (a union "
        "adds only works not held, and discarding a work not held does nothing): only the speed differs"
        for line in (
            "few = None  # the usual case: scanning the list beats building a set of it",
            "few = len(self._d) < 4  # the usual case: scanning the list beats building a set of it",
            "few = len(self._d) <= 5  # the usual case: scanning the list beats building a set of it",
            "for w in [w for w in self._d if w in works] if (few) and False else self._d.keys() & set(works):",
            "for w in [w for w in self._d if w in works] if (few) or True else self._d.keys() & set(works):",
            "for w in [w for w in self._d if w in works] if few else self._d.keys() | set(works):",
        )
    },
    (
        "EngineRecord.measured_beta",
        "return int(5 * tokens / seconds) if tokens >= 64 and seconds >= 0 else 0",
    ): "seconds is 0 only while tokens is 0 too: both grow only from a report with busy time",
    **{
        ("SchedulerCore._absorb", line): "register creates the entry (0) of every node and prefill engine: the "
        "default is never read"
        for line in (
            "self.storage_read_bytes[node] = self.storage_read_bytes.get(node, None) + load.storage_read_bytes",
            "self.storage_read_bytes[node] = self.storage_read_bytes.get(node, ) + load.storage_read_bytes",
            "self.storage_read_bytes[node] = self.storage_read_bytes.get(node, 1) + load.storage_read_bytes",
            "self.prefill_busy_s[load.engine_id] = self.prefill_busy_s.get(load.engine_id, None) + load.prefill_busy_s",
            "self.prefill_busy_s[load.engine_id] = self.prefill_busy_s.get(load.engine_id, ) + load.prefill_busy_s",
            "self.prefill_busy_s[load.engine_id] = self.prefill_busy_s.get(load.engine_id, 1.0) + load.prefill_busy_s",
        )
    },
    **{
        ("SchedulerCore._group_totals", line): "every alive decode engine's group has a private queue (register "
        "creates it; it goes only with the group's last engine): the other branch is never taken"
        for line in (
            "totals[g] += self.private[g].weight if (g in self.private) or True else 0",
            "totals[g] += self.private[g].weight if g in self.private else 1",
        )
    },
    **{
        ("SchedulerCore.live_alpha", line): "a node never measured has a negative time and is measured at once: "
        "the default's values are never returned"
        for line in (
            "at, alpha = self._alphas.get(node, (-2.0, 0))",
            "at, alpha = self._alphas.get(node, (-1.0, 1))",
        )
    },
    (
        "WindowedSums.__init__",
        "def xǁWindowedSumsǁ__init____mutmut_orig(self, window_s: float = 31.0, clock=time.monotonic):",
    ): "every caller passes the window (SchedulerCore: balance_window_s): the default is never used",
    ("drain_rate", 'tokens, busy, end = 0.0, 0.0, float("-INF")'): "float() reads -INF as -inf",
    ("drain_rate", "if stop >= end:"): "an interval ending where the union ends adds stop - end = 0 and leaves end",
    (
        "measured_alpha",
        "return int(3 * tokens / busy) if busy >= min_drain_s and tokens >= 0 else 0",
    ): "with no token read the rate is int(0 / busy) = 0 either way",
    # the sampler: its tensors are 2-D ([rows, vocab]), where dim +1 is dim -1
    **{
        (f, line): "the tensor is 2-D ([rows, vocab]): dimension +1 is dimension -1"
        for f, line in (
            ("_draw", "cdf = probs.cumsum(+1)"),
            ("_logprob_parts", "lp = logits.log_softmax(+1)"),
            ("_logprob_parts", "parts = [at[:, 0]] + ([(lp > at).sum(+1) + 1] if rank else [])"),
            ("_logprob_parts", "top = lp.topk(k, dim=+1)"),
            ("_restricted", "at, _ = entries.on(logits.device, logits.shape[+1])"),
            (
                "_restricted",
                "allowed = torch.zeros(len(rows), logits.shape[+1], dtype=torch.bool, device=logits.device)",
            ),
            ("sample", "tokens = logits.argmax(+1)"),
            ("sample", "k_max = min(max([params[i].top_k for i in drawn] + [0]), logits.shape[+1])  # top_k <= 0: off"),
        )
    },
    ("_logprob_parts", "top = lp.topk(k, )"): "topk's default dimension is the last",
    ("filtered_probs", "ordered, order = scaled.sort(descending=True)"): "sort's default dimension is the last",
    (
        "adjusted",
        "flat, width = logits.view(-1), logits.shape[+1]  # flat indices: index_select / index_add_ beat 2-D indexing",
    ): "the tensor is 2-D ([rows, vocab]): dimension +1 is dimension -1",
    ("adjusted", "at, (v,) = add_.on(None, width)"): ON_THE_HOST,
    ("adjusted", "at, (f,) = rep.on(None, width)"): ON_THE_HOST,
    ("adjusted", "at, (c, f, pr) = pen.on(None, width)"): ON_THE_HOST,
    (
        "adjusted",
        "flat.index_copy_(0, at, torch.where(old >= 0, old / f, old * f))",
    ): "a logit of exactly 0 is 0 divided or multiplied",
    ("adjusted", "logits = logits.clone(memory_format=None)"): "clone's default keeps a dense tensor's layout (the "
    "logits' rows are contiguous) and makes an expanded one contiguous: view(-1) works on either",
    ("filtered_probs", "kth = scaled.topk(k_max, ).values.gather(1, (k - 1)[:, None])"): "topk's default dimension "
    "is the last",
    ("filtered_probs", "kth = scaled.topk(k_max, dim=+1).values.gather(1, (k - 1)[:, None])"): "the tensor is 2-D "
    "([rows, vocab]): dimension +1 is dimension -1",
    ("_unpacked", "width = logits.shape[+1]"): "the tensor is 2-D ([rows, vocab]): dimension +1 is dimension -1",
    **{
        ("_unpacked", line): "shifting the int32 words by int64 amounts promotes them to int64: the same low 32 bits"
        for line in (
            "shifts = torch.arange(32, dtype=None, device=logits.device)",
            "shifts = torch.arange(32, device=logits.device)",
        )
    },
    ("_unpacked", "shifts = torch.arange(32, dtype=torch.int32, device=None)"): ON_THE_HOST,
    ("_unpacked", "shifts = torch.arange(32, dtype=torch.int32, )"): ON_THE_HOST,
    ("_unpacked", "if bits.shape[1] <= width:"): "at equal widths the padding is zero columns: the same bits",
    (
        "_unpacked",
        "bits = torch.cat([bits, bits.new_zeros(len(rows), width + bits.shape[1])], 1)",
    ): "the padding is wider than needed, and each row is cut to the vocabulary's width after",
    ("_masked", 'return torch.where(allowed, logits, float("-INF"))'): "float() reads -INF as -inf",
    **{
        (f, line): "a list of ints becomes int64 without the dtype too (the lists are never empty here)"
        for f, line in (
            ("_restricted", "entries.add(j, torch.tensor(params[i].allowed_token_ids, dtype=None))"),
            ("_restricted", "entries.add(j, torch.tensor(params[i].allowed_token_ids, ))"),
            ("prompt_logprobs", "chosen = torch.tensor(ids, dtype=None).to(hidden.device, non_blocking=True)"),
            ("prompt_logprobs", "chosen = torch.tensor(ids, ).to(hidden.device, non_blocking=True)"),
        )
    },
    ("_restricted", "at, _ = entries.on(None, logits.shape[-1])"): ON_THE_HOST,
    ("_restricted", "allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=None)"): ON_THE_HOST,
    ("_restricted", "allowed = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, )"): ON_THE_HOST,
    **{
        (f, line): "rank=None is as false as rank=False"
        for f, line in (
            (
                "_with_logprobs",
                "parts = _logprob_parts(logits.index_select(0, rows), tokens.index_select(0, rows), k, rank=None)",
            ),
            (
                "_with_logprobs",
                "read = _read_logprobs(flat[b:], [ids[i] for i in asked], k, [params[i].logprobs for i in asked], rank=None)",
            ),
        )
    },
    ("extend_prompt_logprobs", "if start >= p1 or len(done) > p1:"): "at len(done) == p1 the rows and ids to add are "
    "empty (and start < p1: no gap to refuse): nothing is added either way",
    (
        "extend_prompt_logprobs",
        "done += prompt_logprobs(logits_of, hidden[p0 - start : p1 + start], prompt_ids[p0 + 1 : p1 + 1], k)",
    ): "prompt_logprobs reads as many rows of hidden as there are ids: the longer slice's extra rows are never read",
    (
        "prompt_logprobs",
        "logits_of, hidden: torch.Tensor, next_ids: Sequence[int], k: int, rows_per_pass: int = 257",
    ): "passes of 257 rows instead of 256: the same rows, the same answers",
    **{
        ("sample", line): "with every row drawn, taking them all by index and putting them back in order is the batch"
        for line in (
            "rows = torch.tensor(drawn).to(dev, non_blocking=True) if (len(drawn) < b) or True else None",
            "rows = torch.tensor(drawn).to(dev, non_blocking=True) if len(drawn) <= b else None",
        )
    },
    **{
        ("sample", line): "every knob is read back as float32 (top_k as an integer) and the draw is a float32 number: "
        "building them in float32 gives the same values"
        for line in ("dtype=None,", ").to(dev, non_blocking=True)  # one copy; float64 keeps the draw")
    },
    (
        "sample",
        "k_max = min(max([params[i].top_k for i in drawn] + [1]), logits.shape[-1])  # top_k <= 0: off",
    ): "with every row's top_k off its floor is -inf: the top-1 is computed and not applied",
    **{
        ("sample", line): "top_p = 1 drops no token: the tokens strictly more likely never cover more than all of it "
        "(but for float32 rounding, which could drop a token of probability ~1e-7)"
        for line in (
            "top_p = knobs[:, 2].float() if (any(params[i].top_p < 1.0 for i in drawn)) or True else None",
            "top_p = knobs[:, 2].float() if any(params[i].top_p <= 1.0 for i in drawn) else None",
            "top_p = knobs[:, 2].float() if any(params[i].top_p < 2.0 for i in drawn) else None",
        )
    },
    **{
        ("sample", line): "min_p = 0 keeps every token: its floor is max + log(0) = -inf"
        for line in (
            "min_p = knobs[:, 3].float() if (any(params[i].min_p > 0.0 for i in drawn)) or True else None",
            "min_p = knobs[:, 3].float() if any(params[i].min_p >= 0.0 for i in drawn) else None",
        )
    },
    (
        "TokenHistory.__init__",
        "self.bad_words = BadWords(params.bad_words) if (params.bad_words) or True else None",
    ): "an index of no words is never read: adjusted() reads it only for rows that have bad words",
    ("TokenHistory.__init__", "self._counts = np.zeros(17, dtype=np.float32)"): "the counts' spare slot is never "
    "read (tensors() reads the first k) and growing zeroes everything past k",
    (
        "TokenHistory.add",
        "self._ids, self._counts = np.resize(self._ids, 2 * k), np.resize(self._counts, 3 * k)",
    ): "the counts grow to 3k instead of 2k: never shorter than the ids, zeroed past k, read up to k",
    **{
        ("_Entries.on", line): "the values are read back as float32 (flat[...].float()): building them in float32 "
        "first gives the same numbers"
        for line in (
            "else torch.tensor(col, dtype=None).repeat_interleave(lens)",
            "else torch.tensor(col, ).repeat_interleave(lens)",
            "if (any(torch.is_tensor(v) for v in col)) or True",
        )
    },
    **{
        ("adjusted", line): "the ids become int64 anyway: a non-empty list of ints is int64 without the dtype, and "
        "_Entries.on casts every entry's ids to long after concatenating them, so an empty ban (float32 without the "
        "dtype) bans nothing all the same (test_min_tokens_with_nothing_to_ban_leaves_the_row_as_it_is)"
        for line in (
            "sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))), dtype=None",
            "sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))), )",
        )
    },
    # agent sessions
    ("_LogMoments.__init__", "self.count, self._mean, self._m2 = 0, 1.0, 0.0"): "the first gap sets the mean "
    "whatever it was (mean += (x - mean) / 1) and adds d x 0 to m2; before it, count 0 hides the mean",
    **{
        ("GapEstimator.log_params", line): "an empty prior weighs w = 0: its mean is multiplied by 0 in both the "
        "mean and the variance (and an empty prior's mean is 0.0 anyway)"
        for line in (
            "p_mean = prior._mean if (prior.count) or True else 0.0",
            "p_mean = prior._mean if prior.count else 1.0",
        )
    },
    # the transport
    ("TransferHandle.__init__", 'self._error: BaseException | None = ""'): "_finish sets the error before the event "
    "a waiter waits for: the initial value is never read",
    ("Transport.__init__", "self._closed = None"): "read only as a truth value: None is as false as False",
    **{
        ("Transport.add_peer", line): "for a peer not known yet the address counts as moved, and forgetting a peer "
        "not known does nothing"
        for line in (
            "moved = self._peer_address.get(peer, None) != address",
            "moved = self._peer_address.get(peer, ) != address",
        )
    },
    **{
        ("Transport.allocate", line): "page-locking needs CUDA: on the host (this run is CPU-only) memory pinned or "
        "not is the same"
        for line in (
            "def xǁTransportǁallocate__mutmut_orig(self, nbytes: int, pin: bool = False) -> HostMemory:",
            "return HostMemory(nbytes, shared=self.remote_needs_shared_memory, pin=None)",
            "return HostMemory(nbytes, shared=self.remote_needs_shared_memory, )",
        )
    },
    (
        "_Lane.run",
        "if now - last_check >= PEER_CHECK_INTERVAL_S:  # a liveness probe may cost a syscall or two",
    ): "the clock's difference equals 0.02 s exactly only by chance: then a piece is probed once more",
    ("_Lane.run", "last_check = 1.0"): "the monotonic clock is far past 1 s: the first piece is probed either way",
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
                **({"(the file's other functions)": part.rest} if part.only else {}),
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


# mutmut's timeout thread sends SIGXCPU to each child's pid at its deadline, whether or not the child has ended: a
# pid the system has given to another process since (pid_max is 32768 on many machines, and mutmut forks thousands)
# would get it, or a thread of mutmut itself. Run with the signal sent only to the child the deadline was set for.
LAUNCHER = """
import os, sys, types
import mutmut.workers.isolation as isolation
import mutmut.workers.timeout as timeout

started = {}


def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[1], fields[19]  # parent, start time
    except OSError:
        return None


def register(pid, timeout_s):
    started[pid] = stat(pid)
    timeout.register_timeout(pid, timeout_s)


def kill(pid, sig):
    now = stat(pid)
    if now is not None and now == started.get(pid) and now[0] == str(os.getpid()):
        os.kill(pid, sig)


timeout.os = types.SimpleNamespace(kill=kill, getpid=os.getpid)
isolation.register_timeout = register
from mutmut.__main__ import cli

sys.argv[0] = "mutmut"
cli()
"""


def run_mutmut(work: Path, globs: list[str], max_children: int, python: str) -> float:
    # one intra-op thread: mutmut forks a child per mutant from a process that has run torch, and a forked child
    # whose parent had started OpenMP's threads hangs in its first parallel op (a "timeout" that is no kill)
    env = {**os.environ, "PYTHONSAFEPATH": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    t = time.monotonic()
    cmd = ["nice", "-n", "10", python, "-c", LAUNCHER, "run", "--max-children", str(max_children), *globs]
    rc = subprocess.run(cmd, cwd=work, env=env, check=False).returncode
    if rc:
        print(f"mutmut exited with {rc}")
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


def mutated_line(work: Path, part_path: str, key: str) -> tuple[str, str]:
    """The lines a mutant changes: (as they were, as changed), stripped, joined by ' / ' when it changes several."""
    orig_key = key.partition("__mutmut_")[0] + "__mutmut_orig"
    mutant = [line.replace(key + "(", orig_key + "(") for line in function_source(work, part_path, key)]
    orig = function_source(work, part_path, orig_key)
    diff = list(difflib.ndiff(orig, mutant))
    was = " / ".join(line[2:].strip() for line in diff if line.startswith("- "))
    now = " / ".join(line[2:].strip() for line in diff if line.startswith("+ "))
    return was, now or "(a line removed)"


def _moves_only(was: str, now: str) -> bool:
    """Whether a mutant changes only the arguments of a ``.to(...)``: the device a tensor goes to, or whether it goes
    there without blocking. On the host, where this run and its tests are, either is the same tensor."""
    strip = lambda line: re.sub(r"\.to\([^()]*\)", ".to()", line)
    return was != now and ".to(" in was and strip(was) == strip(now)


def _last_dim(line: str) -> str:
    return re.sub(r"(?<=[(\[=, ])-1(?=[)\],])", "+1", line)


SAMPLER = {"dualpath.engines.sampler"}  # whose tensors are all 2-D here: [rows, vocab]


def equivalence(module: str, name: str, was: str, now: str) -> str | None:
    """Why a surviving mutant computes the same thing, or None: ``EQUIVALENT``, else one of the rules below."""
    if (name, now) in EQUIVALENT:
        return EQUIVALENT[(name, now)]
    if _moves_only(was, now):
        return ON_THE_HOST
    if was != now and was.replace('"-inf"', '"-INF"') == now:
        return 'float() reads "-INF" as -inf'
    if module in SAMPLER and was != now and _last_dim(was) == now:
        return "the tensor is 2-D ([rows, vocab]): dimension +1 is dimension -1"
    return None


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
                was, now = mutated_line(work, part.path, key[len(part.module) + 1 :])
                reason = equivalence(part.module, name, was, now)
                counts["equivalent"] += reason is not None and status == "survived"
                survivors.append(
                    {
                        "mutant": key,
                        "function": name,
                        "status": status,
                        "was": was,
                        "mutated": now,
                        "equivalent": reason,
                    }
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
    ap.add_argument("--seconds", type=float, help="with --report-only: the run's wall time, for the result")
    ap.add_argument("--min-score", type=float, help="exit 1 below this score, or with a survivor not explained (CI)")
    ap.add_argument("--out", default=str(RESULTS / "mutation.json"))
    ap.add_argument("--note", default="", help="how the verdicts were gathered (with --report-only: which runs)")
    args = ap.parse_args()
    work = Path(args.work).resolve()
    assert ROOT not in work.parents and work != ROOT, "the work copy must be outside the repository"
    if not args.report_only:
        assert args.only or not args.tests, "--tests goes with --only"
        check_mutmut(args.python)
        prepare(work, args.fresh, args.tests or TESTS)
    globs, report = scope_report(work / "src")
    seconds = args.seconds
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
        "note": args.note,
        "max_children": args.max_children,
        "tests": TESTS,
        "tests_left_out": f"those using a model fixture ({', '.join(MODEL_FIXTURES)}): seconds each per mutant",
        "test_timeout_s": TEST_TIMEOUT_S,
        "imported_from": imported_from(work, args.python),  # the mutated copy, not the repository's file
        "scope": report,
        "scope_notes": [
            "properties are mutated too: in the work copy each plain @property getter becomes a method wrapped by "
            "property() (mutmut mutates no decorated function); their mutants are named ..._property_<name>",
            "lines matching not_mutated_lines are left alone: what is logged, and the message and field of an "
            "error raised (the condition that raises it is mutated)",
            "the run is on the host (CPU): mutants that change only where a tensor is moved count as equivalent",
            "tests that load a model are left out (tests_left_out); the sampler's unit tests cover its logic",
        ],
        "not_mutated_lines": DO_NOT_MUTATE,
        "equivalent": [s for s in survivors if s["equivalent"]],
        "unexplained_survivors": unexplained,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    if args.min_score is not None and (total["score"] < args.min_score or unexplained):
        sys.exit(
            f"score {total['score']} (at least {args.min_score} wanted), {len(unexplained)} survivor(s) unexplained"
        )


if __name__ == "__main__":
    main()
