"""The signals the scheduler places requests by, as real engines report them: a prefill and a decode engine (tiny
model, CPU, real files, shm between them) report to a real ``SchedulerCore`` in this process, and at known
moments each engine's ``EngineLoad`` is checked field by field against what it holds (the storage read queue in
tokens and the bytes read, the tokens still to prefill, the free KV memory, seq and tok), and the core's view
against the engines' reports: a node's read queue is the sum of its engines' queues, an engine's load is its
report plus the work handed to it since (its hit charged as read, not as compute).

The reads are held back (``hold_reads``: the store's one I/O thread busy), so the queue is known exactly: every
hit block waits, none completed."""

import threading
from contextlib import contextmanager

import pytest

from dualpath.core.geometry import choice_blocks
from dualpath.core.messages import ReadPath
from engines_on_core import (
    EngineSpec,
    current_load,
    engines_on_core,
    hold_reads,
    store_prefix,
    submit,
    wait_for,
)

BS = 16
N = 5 * BS + 3  # prompt tokens: 5 full blocks and 3 tokens
MAX_TOKENS = 4
PROMPT_A = [(i * 7) % 250 + 3 for i in range(N)]
PROMPT_B = [(i * 11 + 5) % 250 + 3 for i in range(N)]
HIT_A, HIT_B = 4 * BS, 3 * BS  # stored prefixes (an earlier turn's)
PROMPT_C = [(i * 13 + 1) % 250 + 3 for i in range(N)]
HIT_C = 4 * BS


def _work_id(events) -> str:
    return next(ev.work_id for ev in events if ev.kind == "assigned")


def _path(events) -> str:
    return next(ev.path for ev in events if ev.kind == "assigned")


def _reserve(n: int) -> int:
    """KV tokens a decode engine reserves for a greedy reply of MAX_TOKENS after ``n`` prompt tokens."""
    return choice_blocks(BS, n, n + MAX_TOKENS, 1) * BS


@contextmanager
def _prefill_and_decode(tiny_dirs, tmp_path, de_node: str, stored: dict):
    """A prefill engine on node n1 and a decode engine on ``de_node``; ``stored`` prompts' prefixes (prompt -> hit
    tokens) in the store, as an earlier turn left them."""

    def setup(engines):
        for prompt, hit in stored.items():
            store_prefix(engines["pe"], list(prompt), hit // BS)

    specs = [EngineSpec("prefill", "pe", "n1"), EngineSpec("decode", "de", de_node)]
    with engines_on_core(tiny_dirs["llama"], tmp_path, BS, specs, setup=setup) as (core, engines):
        yield core, engines["pe"], engines["de"]


@pytest.fixture
def one_node(tiny_dirs, tmp_path):
    """Both engines on node n1, prompts A and B partly stored."""
    with _prefill_and_decode(tiny_dirs, tmp_path, "n1", {tuple(PROMPT_A): HIT_A, tuple(PROMPT_B): HIT_B}) as cell:
        yield cell


def test_each_engine_reports_what_it_holds_and_the_node_sums_its_engines(one_node):
    """A on the PE path (4 stored blocks read by the prefill engine), B on the DE path (3 read by the decode
    engine), both on node n1, reads held: each engine's report is exact, the node's queue is their sum; once the
    reads land the queues empty and the bytes read are reported; once prefilled the prefill engine holds nothing."""
    core, pe, de = one_node
    g = pe.geometry
    idle = current_load(pe), current_load(de)
    assert [(x.seq, x.tok, x.read_q_tokens) for x in idle] == [(0, 0, 0), (0, 0, 0)]
    assert idle[0].free_tokens == pe.capacity_tokens() and idle[1].free_tokens == de.capacity_tokens()
    assert core.node_state("n1").read_q == 0

    with hold_reads(pe, de):
        a, b = submit(core, "a", PROMPT_A, MAX_TOKENS, mode="pe"), submit(core, "b", PROMPT_B, MAX_TOKENS, mode="de")
        assert [a[0].num_hit_tokens, b[0].num_hit_tokens] == [HIT_A, HIT_B]
        de._pull()  # both requests take the decode engine (phase 1 and 2)
        de_view = core._state(core.engines["de"])
        assert (de_view.seq, de_view.tok, de_view.free_tokens) == (
            2,
            2 * N,
            de.capacity_tokens() - _reserve(N) * 2,
        )
        pe._pull()  # ... and the prefill engine, each on its path
        assert (_path(a), _path(b)) == ("pe", "de")
        # handed out, not yet reported: the scheduler charges the prefill engine the tokens it computes (the miss),
        # never the hit, which is read
        pe_view = core._state(core.engines["pe"])
        assert (pe_view.seq, pe_view.tok) == (2, (N - HIT_A) + (N - HIT_B))

        def queued() -> bool:
            return (
                pe.accounting.snapshot().waiting_bytes == HIT_A // BS * g.full_block_bytes
                and de.accounting.snapshot().waiting_bytes == HIT_B // BS * g.full_block_bytes
                and len(de.held()) == 2
            )

        wait_for(queued, what="both reads queued and both requests reserved on the decode engine")
        p, d = current_load(pe), current_load(de)
        assert (p.seq, p.tok, p.read_q_tokens) == (2, (N - HIT_A) + (N - HIT_B), HIT_A)
        assert p.free_tokens == pe.capacity_tokens() and p.storage_read_bytes == 0
        assert sorted(p.request_ids) == sorted([_work_id(a), _work_id(b)])
        assert (d.seq, d.tok, d.read_q_tokens) == (2, 2 * N, HIT_B)
        assert d.free_tokens == de.capacity_tokens() - 2 * _reserve(N) and d.storage_read_bytes == 0

        pe._pull()
        de._pull()
        node = core.node_state("n1")
        assert node.read_q == p.read_q_tokens + d.read_q_tokens == HIT_A + HIT_B
        stats = core.stats()
        assert stats["node_read_q_tokens"] == {"n1": HIT_A + HIT_B}
        assert stats["engines"]["pe"]["tokens"] == p.tok and stats["engines"]["de"]["tokens"] == d.tok
        assert stats["engines"]["de"]["free_tokens"] == d.free_tokens
        # reported, the engines' numbers replace what the scheduler charged them
        pe_view, de_view = core._state(core.engines["pe"]), core._state(core.engines["de"])
        assert (pe_view.seq, pe_view.tok) == (p.seq, p.tok)
        assert (de_view.seq, de_view.tok, de_view.free_tokens) == (d.seq, d.tok, d.free_tokens)

    wait_for(lambda: pe.accounting.queue_tokens == 0 and de.accounting.queue_tokens == 0, what="the held reads to land")
    p, d = current_load(pe), current_load(de)
    assert (p.read_q_tokens, d.read_q_tokens) == (0, 0)
    assert p.storage_read_bytes == HIT_A // BS * g.full_block_bytes
    assert d.storage_read_bytes == HIT_B // BS * g.full_block_bytes
    assert (p.seq, p.tok) == (2, (N - HIT_A) + (N - HIT_B))  # read, not yet computed
    pe._pull()
    de._pull()
    assert core.node_state("n1").read_q == 0
    assert core.storage_read_bytes["n1"] == (HIT_A + HIT_B) // BS * g.full_block_bytes
    assert current_load(pe).storage_read_bytes == 0  # delivered: counted once

    prefill = threading.Thread(target=pe.loop, daemon=True)
    prefill.start()
    wait_for(lambda: not pe.held(), what="both prompts prefilled and handed off")
    pe.stopping.set()
    prefill.join(30)
    p, d = current_load(pe), current_load(de)
    assert (p.seq, p.tok, p.read_q_tokens) == (0, 0, 0)
    assert (d.seq, d.tok) == (2, 2 * N)  # held by the decode engine (its loop does not run here)
    assert d.free_tokens == de.capacity_tokens() - 2 * _reserve(N)


@pytest.fixture
def two_nodes(tiny_dirs, tmp_path):
    """The decode engine on node n2, prompts A and C partly stored."""
    with _prefill_and_decode(tiny_dirs, tmp_path, "n2", {tuple(PROMPT_A): HIT_A, tuple(PROMPT_C): HIT_C}) as cell:
        yield cell


def test_the_read_path_follows_the_reported_read_queues(two_nodes):
    """A is read on the PE path and held there: the prefill engine's node n1 reports a queue of A's hit, n2 none.
    C, in dualpath mode, must be read on the decode engine's side; with equal queues (as a blind scheduler sees
    them) it would go to the PE side, the tie's rule."""
    core, pe, de = two_nodes
    with hold_reads(pe):
        a = submit(core, "a", PROMPT_A, MAX_TOKENS, mode="pe")
        de._pull()
        pe._pull()
        assert _path(a) == ReadPath.PE.value
        wait_for(lambda: pe.accounting.queue_tokens == HIT_A, what="A's read queued")
        pe._pull()  # reported: n1's queue is A's hit
        assert [core.node_state(n).read_q for n in ("n1", "n2")] == [HIT_A, 0]
        c = submit(core, "c", PROMPT_C, MAX_TOKENS)
        de._pull()
        pe._pull()
        assert c[0].num_hit_tokens == HIT_C and _path(c) == ReadPath.DE.value
        assert core.counters["path_pe"] == 1 and core.counters["path_de"] == 1
