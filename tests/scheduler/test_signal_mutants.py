"""The load signals the scheduler balances by, at the edges the cluster-level tests leave open (found by
``bench/mutation.py``): the sliding windows of read bytes and busy time, max/avg, a node's measured read rate."""

from dualpath.core.config import SchedulerConfig
from dualpath.core.messages import EngineInfo, EngineLoad, Role
from dualpath.scheduler.balance import WindowedSums, drain_rate, max_over_avg, measured_alpha
from dualpath.scheduler.core import SchedulerCore
from dualpath.scheduler.policies import make_policy


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_a_window_sums_each_keys_increments_of_its_last_seconds():
    clock = Clock()
    w = WindowedSums(10.0, clock)
    w.add("a", 5.0)
    clock.t = 4.0
    w.add("a", 3.0)
    w.add("b", 0.0)  # counted in the average, with nothing
    assert w.sum("a") == 8.0 and w.sums() == {"a": 8.0, "b": 0.0}
    clock.t = 10.0  # the first increment is exactly window_s old: still in
    assert w.sum("a") == 8.0
    clock.t = 10.5
    assert w.sums() == {"a": 3.0, "b": 0.0}
    clock.t = 14.5
    assert w.sum("a") == 0.0 and w.sum("nobody") == 0.0


def test_tracked_and_forgotten_keys():
    w = WindowedSums(10.0, Clock())
    w.track("idle")
    w.add("busy", 2.0)
    assert w.sums() == {"idle": 0.0, "busy": 2.0}
    w.forget("busy")
    assert w.sums() == {"idle": 0.0}
    assert w.sums({"busy"}) == {"busy": 2.0}  # its increments still count when asked for by name
    w.forget("never-added")


def test_max_over_avg_and_a_nodes_measured_read_rate():
    assert max_over_avg([]) == 1.0 and max_over_avg([0.0, 0.0]) == 1.0
    assert max_over_avg([1.0, 3.0]) == 1.5 and max_over_avg(iter([2.0, 2.0, 2.0])) == 1.0
    assert drain_rate([[0, 2, 10], [0.5, 1.5, 5]]) == (15, 2)  # a read inside another adds no time
    assert measured_alpha([[0, 1, 100]]) == 300  # exactly the minimum drain time: a rate
    assert measured_alpha([[0, 1, 0]]) == 0  # waited a second and read nothing: no rate
    assert measured_alpha([[0, 0.75, 50], [1, 1.25, 50]], min_drain_s=1.0) == 300


# --- the scheduler core's view of its engines -------------------------------------------------------------------
BS = 16


def _info(eid, role, node, capacity=1000, alpha=0, beta=0, group=""):
    return EngineInfo(
        eid, role, node, f"{eid}:1", "shm", {}, [], 1, 64, BS, 2, "ab" * 16, capacity, max_model_len=4096,
        group_id=group, alpha_tokens=alpha, beta_tokens=beta,
    )  # fmt: skip


def _core(*infos):
    clock = Clock()
    core = SchedulerCore(
        SchedulerConfig(kv_store="/nonexistent", heartbeat_timeout_s=1e9), make_policy("dualpath"), clock
    )
    for i in infos:
        assert core.register(i).ok
    return core, clock


def test_a_prefill_engines_measured_beta_decays_older_reports_and_needs_64_tokens():
    core, clock = _core(_info("p0", Role.PREFILL, "n0", beta=7), _info("d0", Role.DECODE, "n1"))
    p0 = core.engines["p0"]
    assert p0.measured_beta() == 0
    core.report(EngineLoad("p0", 0, 0, 0, 0, prefill_busy_s=1.0, prefill_tokens=63))
    assert p0.measured_beta() == 0  # under 64 tokens: too few to go by
    core.report(EngineLoad("p0", 0, 0, 0, 0, prefill_busy_s=1.0, prefill_tokens=1000))
    assert p0.prefilled == (0.8 * 63 + 1000, 0.8 * 1.0 + 1.0)
    assert p0.measured_beta() == int(5 * (0.8 * 63 + 1000) / 1.8)
    assert core.prefill_busy_s["p0"] == 2.0 and core.busy_window.sum("p0") == 2.0
    core.report(EngineLoad("d0", 0, 0, 0, 0, prefill_busy_s=5.0, prefill_tokens=5000))  # a decode engine's: no
    assert core.engines["d0"].prefilled == (0.0, 0.0) and "d0" not in core.prefill_busy_s
    state = core._state(p0)
    assert (state.beta, state.measured_beta) == (7, p0.measured_beta())
