"""An engine's load report field by field, on engines built without a model (``object.__new__``: the report reads
only counters, the read accounting, the outbox and the role's ``held``/``free_tokens``), so each number the
scheduler places requests by is pinned exactly, and a second report carries only what changed since the first
was delivered. The mutation run (``bench/mutation.py``) uses these: ``test_live_signals`` checks the same numbers
on real engines, at seconds a test."""

import threading
from types import SimpleNamespace

from dualpath.core.messages import Role
from dualpath.engines.decode import Choice, DecodeEngine, Held
from dualpath.engines.engine import Engine, Outbox
from dualpath.engines.prefill import Job, PrefillEngine
from dualpath.traffic.storage.accounting import ReadAccounting

BS = 16
KEY_A, KEY_B, KEY_C = b"a" * 16, b"b" * 16, b"c" * 16


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _engine(cls, **cfg):
    e = object.__new__(cls)
    e.engine_id, e.leaving, e.dp = "e1", False, None
    e.cfg = SimpleNamespace(**{"alpha_tokens": 0, "beta_tokens": 0, **cfg})
    e.geometry = SimpleNamespace(block_size=BS)
    e.clock = Clock()
    e.accounting = ReadAccounting(0.0, 10.0, clock=e.clock)  # 10 bytes a token
    e.outbox = Outbox()
    e.storage = SimpleNamespace(usage=lambda: {"used_bytes": 700, "capacity_bytes": 9000, "corrupt_removed": 3})
    e.traffic = SimpleNamespace(snapshot=lambda: {"pe:low": 123}, prefetcher=None)
    e.rpc_refused = 4
    e.busy_s, e.busy_tokens, e.kv_load_failures = 1.5, 300, 2
    e._read_bytes_reported = e._failures_reported = e._removed_reported = e._refused_reported = 0
    e._busy_reported, e._busy_tokens_reported = 0.0, 0
    return e


def _job(work_id: str, n_prompt: int, computed: int, hit: int) -> Job:
    return Job(
        SimpleNamespace(request_id=work_id), None, [], 0, token_ids=[1] * n_prompt, computed=computed, hit_tokens=hit
    )


def _prefill(jobs, **cfg) -> PrefillEngine:
    e = _engine(PrefillEngine, **cfg)
    e.jobs = SimpleNamespace(live=lambda: jobs)
    e.workspace = SimpleNamespace(blocks=6)
    e.cost = SimpleNamespace(tokens_in=lambda seconds: int(seconds * 1000))
    return e


def _held(work_id: str, prompt: int, outputs: list[int]) -> Held:
    choices = [Choice(SimpleNamespace(output_ids=[7] * n), [], 0) for n in outputs]
    return Held(work_id, prompt, [], n=len(outputs), choices=choices)


def _decode(held: dict, free_blocks: int) -> DecodeEngine:
    e = _engine(DecodeEngine)
    e.lock = threading.RLock()
    e.held_ = held
    e.cache = SimpleNamespace(num_free_blocks=free_blocks)
    e.local = SimpleNamespace(spec_stats={"drafted": 9, "accepted": 5})
    e.cfg.engine = SimpleNamespace(speculative=SimpleNamespace(num_tokens=0))
    return e


def test_a_prefill_engine_holds_the_tokens_it_has_still_to_compute():
    """Tokens still to compute: the prompt less the larger of what was computed and what loaded from storage."""
    jobs = [_job("w1", 100, 30, 0), _job("w2", 80, 16, 48), _job("w3", 64, 64, 32)]
    e = _prefill(jobs)
    assert e.held() == {"w1": 70, "w2": 32, "w3": 0}
    assert e.free_tokens() == e.capacity_tokens() == 6 * BS


def test_a_prefill_engines_beta_is_pinned_or_what_its_cost_model_prefills_in_5_s():
    assert _prefill([]).beta_tokens() == 5000
    assert _prefill([], beta_tokens=777).beta_tokens() == 777


def test_a_decode_engine_holds_each_request_with_its_prompt_and_every_choices_tokens():
    held = {"w1": _held("w1", 40, [3]), "w2": _held("w2", 10, [2, 5, 0])}
    e = _decode(held, free_blocks=5)
    assert e.held() == {"w1": 43, "w2": 17}
    assert e.free_tokens() == 5 * BS
    assert held["w2"].tokens == 17


def test_the_report_carries_each_number_and_then_only_what_changed_since_it_was_delivered():
    e = _prefill([_job("w1", 100, 30, 0), _job("w2", 50, 0, 32)])
    acc = e.accounting
    acc.enqueue(3, 300)  # three blocks of 100 bytes wait: 30 tokens
    acc.start(100)
    acc.finish(100)  # one read (10 tokens), while two still wait
    e.clock.t += 2.0
    e.outbox.add("started", "w1")
    e.outbox.add("finished", "w0")
    e.outbox.add("failed", ["w9", "why"])
    e.outbox.add("stored_keys", KEY_A, KEY_B)
    e.outbox.add("evicted_keys", KEY_C)
    load, marks = e.load()
    assert (load.engine_id, load.seq, load.tok, load.read_q_tokens) == ("e1", 2, 70 + 18, 20)
    assert load.free_tokens == 6 * BS and load.request_ids == ["w1", "w2"]
    assert (load.started, load.finished, load.failed) == (["w1"], ["w0"], [["w9", "why"]])
    assert (load.stored_keys, load.evicted_keys) == (KEY_A + KEY_B, KEY_C)
    assert (load.prefill_busy_s, load.prefill_tokens, load.storage_read_bytes) == (1.5, 300, 100)
    assert (load.kv_load_failures, load.kv_corrupt_removed, load.rpc_refused) == (2, 3, 4)
    assert load.read_intervals == [[100.0, 102.0, 10.0]]
    assert (load.traffic, load.speculative, load.dp_balance, load.prefetch) == ({"pe:low": 123}, {}, 0.0, {})
    assert (load.storage_used_bytes, load.storage_capacity_bytes, load.leaving) == (700, 9000, False)
    assert marks == {
        "items": marks["items"],
        "read": 100,
        "busy": 1.5,
        "busy_tokens": 300,
        "failures": 2,
        "removed": 3,
        "refused": 4,
    }
    assert marks["items"]["started"] == ["w1"] and marks["items"]["stored_keys"] == [KEY_A, KEY_B]

    # undelivered: the next report counts from the same marks
    e.busy_s, e.busy_tokens = 2.0, 350
    assert e.load()[0].prefill_busy_s == 2.0
    e._delivered(marks)
    acc.start(100)
    acc.finish(100)
    e.busy_s, e.busy_tokens, e.kv_load_failures, e.rpc_refused = 2.5, 420, 5, 6
    e.storage.usage = lambda: {"used_bytes": 800, "capacity_bytes": 9000, "corrupt_removed": 7}
    e.leaving = True
    load, _ = e.load()
    assert (load.prefill_busy_s, load.prefill_tokens, load.storage_read_bytes) == (1.0, 120, 100)
    assert (load.kv_load_failures, load.kv_corrupt_removed, load.rpc_refused) == (3, 4, 2)
    assert (load.started, load.stored_keys, load.storage_used_bytes, load.leaving) == ([], b"", 800, True)


def test_a_pinned_alpha_sends_no_drain_intervals_and_the_dp_group_balance_is_reported():
    e = _prefill([], alpha_tokens=5000)
    e.accounting.enqueue(2, 200)
    e.accounting.start(100)
    e.accounting.finish(100)
    e.dp = SimpleNamespace(stats=lambda: {"attention_max_over_avg": 1.25})
    e.traffic.prefetcher = SimpleNamespace(stats=lambda: {"blocks": 4})
    load, _ = e.load()
    assert load.read_intervals == [] and load.read_q_tokens == 10 and load.dp_balance == 1.25
    assert load.prefetch == {"blocks": 4}
    assert _prefill([]).load()[0].read_intervals == []  # nothing waited: no interval


def test_a_decode_report_counts_generated_tokens_and_its_speculative_counts():
    e = _decode({"w1": _held("w1", 40, [3, 4])}, free_blocks=2)
    load, _ = e.load()
    assert (load.seq, load.tok, load.free_tokens, load.speculative) == (1, 47, 2 * BS, {})
    e.cfg.engine.speculative.num_tokens = 3
    assert e.load()[0].speculative == {"drafted": 9, "accepted": 5}
    assert DecodeEngine.role is Role.DECODE and issubclass(DecodeEngine, Engine)


def test_a_store_that_removes_no_corrupt_blocks_reports_none_removed():
    e = _prefill([])
    e.storage.usage = lambda: {"used_bytes": 1, "capacity_bytes": 2}  # no "corrupt_removed" count
    load, marks = e.load()
    assert (load.kv_corrupt_removed, marks["removed"], load.storage_used_bytes) == (0, 0, 1)
