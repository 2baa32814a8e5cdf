"""A request cancelled at any point of its prefill (preparing, ready, in a running batch, between chunks) is gone for
good: the engine loop goes on with other work, and the job's buffer slots are released once, by its last holder.

The crash this guards against (issue 46): a client hung up while its long prompt was being prefilled in chunks;
the engine put the partly prefilled job back on the ready list after the cancel removed it, and the loop died on
``KeyError`` in the next batch's choice.

Also: a request queued behind a full buffer waits its turn while the buffer moves, and is not failed after one
timeout."""

import threading
import time
from types import SimpleNamespace

import pytest

from dualpath.core.messages import Assignment, EngineInfo, ReadPath
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.prefill import Job, PrefillEngine
from dualpath.engines.prefill_jobs import PrefillJobs
from dualpath.engines.sampler import make_generator
from engine_doubles import engine_config, prefill_with_decode_peer
from dualpath.traffic.buffer import BufferPool

BS = 16


def _job(w: str) -> SimpleNamespace:
    return SimpleNamespace(work_id=w)


def test_a_ready_job_cancelled_is_handed_to_the_canceller_once():
    jobs, a = PrefillJobs(), _job("a")
    assert jobs.admit(a) and jobs.requeue(a)
    assert jobs.cancel("a") is a
    assert jobs.cancel("a") is None and "a" not in jobs and list(jobs.live()) == []
    assert jobs.take(lambda ready: [(j, 1) for j in ready], threading.Event(), wait_s=0.01) == []


@pytest.mark.parametrize("gives_back", ["requeue", "finish"])
def test_a_busy_job_cancelled_is_released_by_its_step_and_never_queued_again(gives_back):
    jobs, a = PrefillJobs(), _job("a")
    assert jobs.admit(a)  # busy: preparing
    assert jobs.cancel("a") is None  # the step holds it: only recorded
    assert jobs.cancelled("a") and "a" not in jobs and list(jobs.live()) == []
    assert jobs.cancel("a") is None
    if gives_back == "requeue":
        assert jobs.requeue(a, front=True) is False  # refused: the caller releases it
    else:
        assert jobs.finish(a) is True
    assert not jobs.cancelled("a")
    assert jobs.take(lambda ready: [(j, 1) for j in ready], threading.Event(), wait_s=0.01) == []
    assert jobs.admit(a)  # the id is free again (a retry of the request)


def test_take_makes_jobs_busy_and_requeue_front_puts_them_first():
    jobs = PrefillJobs()
    a, b, c = _job("a"), _job("b"), _job("c")
    for j in (a, b, c):
        assert jobs.admit(j) and jobs.requeue(j)
    batch = jobs.take(lambda ready: [(ready[0], 5)], threading.Event())
    assert batch == [(a, 5)]
    assert jobs.requeue(a, front=True)
    assert jobs.take(lambda ready: [(j, 1) for j in ready], threading.Event()) == [(a, 1), (b, 1), (c, 1)]


def test_admission_is_refused_when_not_allowed_or_already_held():
    jobs, a = PrefillJobs(), _job("a")
    assert not jobs.admit(a, lambda: False)
    assert jobs.admit(a) and not jobs.admit(_job("a"))


@pytest.fixture
def engine(tiny_dirs, tmp_path):
    with prefill_with_decode_peer(tiny_dirs["llama"], tmp_path, BS) as (pe, peer):
        yield pe, peer.info, peer.pool


def _ready_job(pe: PrefillEngine, de: EngineInfo, de_pool: BufferPool, w: str, n: int) -> Job:
    """A job as ``_prepare`` leaves it: nothing stored, buffer slots here and at the decode engine, ready."""
    g = pe.geometry
    tokens = list(range(3, 3 + n))
    params = SamplingParams(temperature=0, max_tokens=1)
    job = Job(
        Assignment(w, tokens, params.to_dict(), [], ReadPath.PE, True, de), params, [make_generator(params)], 0, tokens
    )
    job.pe_slots = pe.buffer.allocate(g.num_blocks(n), w)
    job.de_slots = de_pool.allocate(g.num_blocks(n), w)
    assert pe.jobs.admit(job) and pe.jobs.requeue(job)
    return job


def test_a_cancel_during_a_chunk_leaves_the_engine_serving(engine):
    """Chunked prefill, one block a batch; the first job is cancelled while its first chunk computes. The loop must
    not run it again, must release its slots, and must go on to prefill the next job to its hand-off."""
    pe, de, de_pool = engine
    free_at_start = pe.buffer.num_free
    pe._choose = lambda ready: [(ready[0], min(BS, ready[0].n_prompt - ready[0].computed))]
    ran, handed = [], []
    prefill = pe._prefill

    def spied(jobs, ws, basic):
        ran.append([j.work_id for j, _ in jobs])
        if ran == [["gone"]]:
            pe.on_cancel("gone", "client disconnected")  # the client hangs up mid-chunk
        return prefill(jobs, ws, basic)

    pe._prefill = spied
    pe._hand_off = lambda finals: handed.extend(j.work_id for j, _ in finals)
    gone = _ready_job(pe, de, de_pool, "gone", 3 * BS + 5)
    loop = threading.Thread(target=pe.loop, daemon=True)
    loop.start()
    deadline = time.monotonic() + 30
    while not ran and time.monotonic() < deadline:
        time.sleep(0.01)
    kept = _ready_job(pe, de, de_pool, "kept", 2 * BS + 3)
    while "kept" not in handed and loop.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert loop.is_alive(), "the prefill loop died"
    assert handed == ["kept"]
    assert ran.count(["gone"]) == 1 and ["gone"] not in ran[1:]
    assert "gone" not in pe.jobs and "gone" not in pe.buffer.leaks()
    assert kept.computed == kept.n_prompt
    pe.jobs.finish(kept)
    pe.buffer.free_owner("kept")
    assert pe.buffer.num_free == free_at_start
    assert gone.computed == BS  # its one chunk ran; nothing after the cancel


def test_a_decode_engine_keeps_a_cancelled_prompts_buffer_slots_until_its_prefill_engine_is_done(tiny_dirs, tmp_path):
    """A cancel from the scheduler reaches the decode engine while the prefill engine may still be writing the
    prompt's KV into the decode engine's buffer: its device blocks are freed at once, its buffer slots only when
    the prefill engine's ``Release`` says nothing is in flight (or, without one, after ``settle_s``). Freed at
    once, a late write would land in the next request's prompt."""
    from dualpath.core.messages import PrepareRequest, RequestRef
    from dualpath.engines.decode import DecodeEngine

    de = DecodeEngine(engine_config("decode", tiny_dirs["llama"], tmp_path, BS, buffer_bytes=2 << 20))
    try:
        free_slots, free_blocks = de.buffer.num_free, de.cache.num_free_blocks
        for w in ("a", "b"):
            reply, _ = de._reserve(PrepareRequest(w, 3 * BS, 0, b"", 8))
            assert reply.ok
        de._drop("a", "cancelled by the scheduler")  # before its hand-off: the prefill engine may be writing
        assert "a" not in de.held_ and "a" in de.buffer.leaks()
        de.Release(RequestRef("a", "cancelled during its prefill"), None)
        de._drain_inbox(block=True)
        assert "a" not in de.buffer.leaks() and not de.settling
        de._drop("b", "cancelled by the scheduler")
        assert "b" in de.buffer.leaks()
        de.settling["b"] = 0.0  # its prefill engine died: no Release comes
        de._settle_overdue()
        assert de.buffer.num_free == free_slots and de.cache.num_free_blocks == free_blocks
    finally:
        de.stopping.set()
        de.stop()


def test_a_prompt_queued_behind_a_full_buffer_waits_its_turn_instead_of_failing(engine):
    """The buffer is full of the work ahead, which frees it a slot at a time over longer than the transport's op
    timeout: the request waits as long as slots keep freeing, then prepares; it is not failed after one timeout (as
    it was: "preparing failed: need 3 blocks, 0 free")."""
    from dataclasses import replace

    from dualpath.core.messages import PrepareReply

    pe, de, de_pool = engine
    pe.cfg = replace(pe.cfg, transport=replace(pe.cfg.transport, op_timeout_s=0.3))
    n = 2 * BS + 3  # 3 blocks
    ahead = pe.buffer.allocate(pe.buffer.num_free, "ahead")
    for i, slot in enumerate(ahead[:3]):
        threading.Timer(0.2 * (i + 1), pe.buffer.free, args=([slot],)).start()
    pe._de = lambda a: SimpleNamespace(call=lambda *_, **__: PrepareReply(True, de_pool.allocate(3, a.request_id)))
    params = SamplingParams(temperature=0, max_tokens=1)
    tokens = list(range(3, 3 + n))
    job = Job(
        Assignment("w", tokens, params.to_dict(), [], ReadPath.PE, True, de),
        params,
        [make_generator(params)],
        0,
        tokens,
    )
    assert pe.jobs.admit(job)
    t = time.monotonic()
    pe._prepare(job)
    assert time.monotonic() - t > 0.5  # longer than one op timeout
    assert len(job.pe_slots) == 3 and "w" in pe.jobs and not pe.outbox.take()["failed"]
