"""The compute-quota batcher with a fixed cost model: exact batches and chunk sizes."""

from dualpath.engines.batcher import CostModel, Pending, form_batch

# 1 ms per new token, nothing else: the quota is a token budget of quota / 1 ms.
LINEAR = CostModel(fixed=0.0, per_token=1e-3, attention=0.0)


def test_whole_requests_join_fifo_while_they_fit():
    q = [Pending("a", 0, 100), Pending("b", 640, 120), Pending("c", 0, 50)]
    assert form_batch(q, LINEAR, 0.300, 64) == [("a", 100), ("b", 120), ("c", 50)]


def test_the_first_request_that_does_not_fit_is_chunked_to_the_largest_fitting_block_end():
    q = [Pending("a", 0, 100), Pending("b", 64, 500), Pending("c", 0, 10)]
    # budget 300 tokens: a takes 100; b may take up to 200 new tokens ending on a block boundary:
    # b starts at 64, so chunks end at 128, 192, 256 -> 64, 128, 192 new tokens; 192 fits (100 + 192 <= 300).
    assert form_batch(q, LINEAR, 0.300, 64) == [("a", 100), ("b", 192)]


def test_chunk_starting_mid_block_ends_on_a_boundary():
    q = [Pending("x", 100, 1000)]
    # 200-token budget: ends at 128 (28), 192 (92), 256 (156); 320 would be 220 > 200
    assert form_batch(q, LINEAR, 0.200, 64) == [("x", 156)]


def test_head_of_queue_always_progresses():
    slow = CostModel(fixed=1.0, per_token=1e-3)  # the fixed cost alone exceeds the quota
    assert form_batch([Pending("a", 0, 500), Pending("b", 0, 5)], slow, 0.300, 64) == [("a", 64)]
    assert form_batch([Pending("a", 30, 500)], slow, 0.300, 64) == [("a", 34)]


def test_attention_term_makes_long_contexts_cost_more():
    m = CostModel(fixed=0.0, per_token=0.0, attention=1e-6)
    # a: 128 * (1000 + 64) = 0.136 s. b starts at 4000, mid-block: 32 tokens to 4032 cost 32 * 4016 = 0.129 s
    # (total 0.265 fits); 96 tokens to 4096 would cost 0.389 s alone. Same new tokens, 4x the context: chunked.
    q = [Pending("a", 1000, 128), Pending("b", 4000, 128)]
    assert form_batch(q, m, 0.300, 64) == [("a", 128), ("b", 32)]


def test_workspace_and_token_limits():
    q = [Pending("a", 0, 100), Pending("b", 0, 100)]
    assert form_batch(q, LINEAR, 10.0, 64, max_blocks=3) == [("a", 100), ("b", 64)]
    assert form_batch(q, LINEAR, 10.0, 64, max_tokens=150) == [("a", 100)]


def test_fit_recovers_known_coefficients():
    truth = CostModel(fixed=0.002, per_token=3e-5, attention=2e-8)
    samples = []
    for c, n in [(0, 64), (0, 512), (1024, 64), (4096, 128), (0, 1024), (2048, 512)]:
        samples.append(([(c, n)], truth.predict([(c, n)])))
    fitted = CostModel.fit(samples)
    for c, n in [(512, 256), (8192, 64)]:
        assert abs(fitted.predict([(c, n)]) - truth.predict([(c, n)])) < 1e-6


def test_a_prefill_engine_batches_its_most_urgent_ready_work_first():
    """The prefill engine's ready work in batch order: loaded work by priority, arrival order within one (work the
    scheduler handed over before an urgent request waits behind it); with nothing loaded, the most urgent alone."""
    from types import SimpleNamespace

    from dualpath.core.sampling_params import SamplingParams
    from dualpath.engines.prefill import PrefillEngine

    jobs = [
        SimpleNamespace(work_id=w, params=SamplingParams(priority=p), loaded=ok)
        for w, p, ok in (("a", 0, True), ("b", 2, True), ("c", -1, True), ("d", 0, True), ("e", -5, False))
    ]
    order = lambda: [j.work_id for j in PrefillEngine._batchable(jobs)]  # noqa: E731
    assert order() == ["c", "a", "d", "b"]
    for job in jobs:
        job.loaded = False
    assert order() == ["e"]
