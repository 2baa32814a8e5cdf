"""Offline rollouts: the trajectory format, forced lengths, resuming after a kill, and the trace generator."""

import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dualpath.client import ClusterClient
from dualpath.launcher import ClusterSpec, LocalCluster
from dualpath.core.errors import DualPathError
from dualpath.rollout.runner import Rollout, RolloutConfig, agent_digest, completed_agents, make_agents, round_seed
from dualpath.core.sampling_params import SamplingParams
from dualpath.rollout.tracegen import PRESETS, generate_trace, measure, trace_shapes
from dualpath.rollout.trajectory import TrajectoryError, read_trajectories, write_trajectories

GOOD = [
    {"id": "a", "rounds": [{"append": [5, 6, 7], "generate": 4}, {"append": "more text", "max_tokens": 3}]},
    {"id": 7, "rounds": [{"append": [1], "generate": 1}]},
]
BAD = [
    ("{not json", "not valid JSON"),
    ('["a"]', "not a JSON object"),
    ('{"id": "", "rounds": [{"append": [1], "generate": 1}]}', "id must be"),
    ('{"id": "x", "rounds": []}', "rounds must be a non-empty list"),
    ('{"id": "x", "rounds": [{"append": [1, -2], "generate": 1}]}', "non-negative token ids"),
    ('{"id": "x", "rounds": [{"append": [1], "generate": 1, "max_tokens": 2}]}', "exactly one of"),
    ('{"id": "x", "rounds": [{"append": [1], "generate": 0}]}', "positive integer"),
    ('{"id": "x", "rounds": [{"append": 5, "generate": 1}]}', "list of token ids or a string"),
    ('{"id": "x", "rounds": [{"append": [1], "generate": 1, "color": 1}]}', "unknown fields"),
    ('{"id": "a", "rounds": [{"append": [1], "generate": 1}]}', "duplicate id"),
]


def test_parser_reads_good_lines_and_names_the_bad_ones(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in GOOD) + "\n\n")
    ts = list(read_trajectories(path))
    assert [t.id for t in ts] == ["a", "7"] and ts[0].rounds[0].forced and not ts[0].rounds[1].forced
    assert ts[0].rounds[1].append == "more text"
    for text, message in BAD:
        path.write_text(json.dumps(GOOD[0]) + "\n" + text + "\n" + json.dumps(GOOD[1]) + "\n")
        with pytest.raises(TrajectoryError, match=f"line 2: .*{message}"):
            list(read_trajectories(path))
        kept = list(read_trajectories(path, skip_invalid=True))
        assert [t.id for t in kept] == ["a", "7"]  # nothing valid is lost


def test_replicated_agents_start_with_distinct_random_rounds(tmp_path):
    ts, _ = generate_trace("32k", 3, scale=0.01, turns_scale=0.1, vocab=(3, 250))
    agents = make_agents(ts, RolloutConfig(agents=7, first_round_tokens=16, vocab=(3, 250)))
    assert len(agents) == 7 and len({a.rounds[0].append for a in agents}) == 7
    assert all(a.rounds[0].generate == 1 and a.rounds[1:] == ts[i % 3].rounds for i, a in enumerate(agents))


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_generated_traces_match_their_targets_within_ten_percent(preset):
    ts, target = generate_trace(preset, 300, scale=0.05, turns_scale=0.25, seed=3)
    got = measure(ts)
    for field in ("turns", "append", "gen", "context", "total"):
        assert abs(getattr(got, field) / getattr(target, field) - 1) < 0.10, (field, got, target)
    assert got.max_len <= target.limit  # no trajectory grows past MaxLen: the paper's traces end there


def test_generated_trajectories_end_near_max_len_with_front_loaded_growth():
    shapes, target = trace_shapes("64k", 2000)
    finals = np.array([sum(a + g for a, g in rs) for rs in shapes])
    assert finals.max() <= 65_536 and np.quantile(finals, 0.05) > 0.65 * 65_536
    rounds = np.array([len(rs) for rs in shapes])
    assert 85 < rounds.mean() < 100 and rounds.max() > 3 * rounds.mean()  # widely spread: size-biased mean 157
    first = np.mean([rs[0][0] for rs in shapes])
    assert first > 3 * target.append  # the system prompt and task come first


@pytest.fixture(scope="module")
def cluster(tiny_dirs, tmp_path_factory):
    spec = ClusterSpec(
        model=str(tiny_dirs["llama"]),
        block_size=16,
        kv_store=str(tmp_path_factory.mktemp("kv")),
        buffer_bytes=8 << 20,
        cache_bytes=32 << 20,
        workspace_tokens=2048,
        cost_model="0.001,0.0001,0",
        scheduling_policy="priority",
    )  # (longest-first's)
    with LocalCluster(spec, run_dir=str(tmp_path_factory.mktemp("run"))) as c:
        yield c


def test_forced_generation_lengths_are_exact(cluster, tmp_path):
    ts, _ = generate_trace("64k", 6, scale=0.02, turns_scale=0.05, vocab=(3, 250), seed=1)
    client = ClusterClient(cluster.scheduler_address)
    summary = Rollout(client, RolloutConfig()).run(ts, tmp_path / "out.jsonl", progress=False)
    client.close()
    recs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    want = {(t.id, i): r.generate for t in ts for i, r in enumerate(t.rounds)}
    assert len(recs) == len(want) == summary["rounds"]
    for rec in recs:
        assert rec["completion_tokens"] == len(rec["output"]) == want[(rec["agent"], rec["round"])]
        assert rec["finish_reason"] == "length"
    later = [r for r in recs if r["round"] > 0]
    assert sum(r["cached_tokens"] for r in later) > 0 and summary["hit_rate"] > 0


@pytest.mark.slow  # (the default run stays under 10 minutes)
def test_a_killed_job_resumes_to_the_same_results(cluster, tmp_path):
    """Sampled (temperature 0.8): each run is its own interpreter, so the rounds' seeds must not depend on one."""
    ts, _ = generate_trace("64k", 8, scale=0.02, turns_scale=0.1, vocab=(3, 250), seed=2)
    traj = tmp_path / "t.jsonl"
    write_trajectories(traj, ts)
    cmd = [
        sys.executable,
        "-m",
        "dualpath.cli",
        "--log-level",
        "WARNING",
        "rollout",
        str(traj),
        "--scheduler",
        cluster.scheduler_address,
        "--no-progress",
        "--temperature",
        "0.8",
    ]
    subprocess.run(cmd + ["--out", str(tmp_path / "clean.jsonl")], check=True, timeout=300)
    out = tmp_path / "resumed.jsonl"
    proc = subprocess.Popen(cmd + ["--out", str(out)])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 30):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    partial = len(out.read_text().splitlines())
    assert 0 < partial < sum(len(t.rounds) for t in ts)  # it really was interrupted
    subprocess.run(cmd + ["--out", str(out)], check=True, timeout=300)

    def per_agent(path):
        recs = [json.loads(line) for line in path.read_text().splitlines()]
        return {(r["agent"], r["round"]): r["output"] for r in recs}

    assert per_agent(out) == per_agent(tmp_path / "clean.jsonl")


class RecordingClient:
    """Test double of ``ClusterClient`` for the runner: answers every round with its forced length, recording each
    request's (agent's first token, round's priority) in order."""

    def __init__(self, policy: str):
        self.policy, self.sent, self.sessions = policy, [], []

    def stats(self):
        return {"scheduling_policy": self.policy}

    def generate_choices(self, context, sampling, mode="", session=None, tool_wait=False):
        from dualpath.client import GenerationResult

        self.sent.append((context[0], sampling.priority))
        self.sessions.append((session, tool_wait))
        return [GenerationResult("r", [3] * sampling.max_tokens, "length") for _ in range(sampling.n)]


def test_longest_first_sends_the_agents_with_most_rounds_left_first(tmp_path):
    """Each round's priority is minus the rounds its agent has left (this one included), and agents start longest
    first under max_concurrency; a scheduler that does not order by priority is refused before anything runs."""
    from dualpath.rollout.trajectory import Round, Trajectory

    ts = [Trajectory(f"t{k}", tuple(Round((100 + k,), generate=1) for _ in range(n))) for k, n in enumerate((2, 4, 1))]
    client = RecordingClient("priority")
    Rollout(client, RolloutConfig(longest_first=True, max_concurrency=1)).run(ts, tmp_path / "o.jsonl", progress=False)
    assert client.sent == [(101, -4), (101, -3), (101, -2), (101, -1), (100, -2), (100, -1), (102, -1)]
    # each agent is one session; every round but its last is followed by a tool call
    assert [(s.id, wait) for s, wait in client.sessions[:4]] == [("t1/0", True)] * 3 + [("t1/0", False)]
    plain = RecordingClient("fcfs")
    Rollout(plain, RolloutConfig(max_concurrency=1)).run(ts, tmp_path / "p.jsonl", progress=False)
    assert [p for _, p in plain.sent] == [0] * 7 and [t for t, _ in plain.sent][:2] == [100, 100]
    with pytest.raises(DualPathError, match="--scheduling-policy priority"):
        Rollout(plain, RolloutConfig(longest_first=True)).run(ts, tmp_path / "q.jsonl", progress=False)


def test_longest_first_through_the_cli_changes_no_result(cluster, tmp_path):
    ts, _ = generate_trace("64k", 4, scale=0.02, turns_scale=0.05, vocab=(3, 250), seed=5)
    traj = tmp_path / "t.jsonl"
    write_trajectories(traj, ts)
    cmd = [
        sys.executable,
        "-m",
        "dualpath.cli",
        "--log-level",
        "WARNING",
        "rollout",
        str(traj),
        "--scheduler",
        cluster.scheduler_address,
        "--no-progress",
    ]
    outputs = []
    for name, extra in (("plain", []), ("longest", ["--longest-first", "--max-concurrency", "2"])):
        subprocess.run(cmd + ["--out", str(tmp_path / f"{name}.jsonl"), *extra], check=True, timeout=300)
        recs = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        outputs.append({(r["agent"], r["round"]): r["output"] for r in recs})
    assert outputs[0] == outputs[1] and len(outputs[0]) == sum(len(t.rounds) for t in ts)


def test_a_longest_first_job_starts_its_cluster_ordering_by_priority_without_preempting(tmp_path, monkeypatch):
    """The job's gain was measured as a queue order: its own cluster orders by priority and does not preempt (a
    preempted reply reloads its context); without --longest-first the cluster's defaults stand."""
    from dualpath.cli import build_parser
    from dualpath.rollout.cli import rollout_main
    from dualpath.serving import serve

    ts, _ = generate_trace("64k", 2, scale=0.02, turns_scale=0.05, vocab=(3, 250), seed=5)
    write_trajectories(tmp_path / "t.jsonl", ts)
    seen = []

    def no_cluster(args):
        seen.append((args.scheduling_policy, args.disable_priority_preemption))
        raise RuntimeError("no cluster in this test")

    monkeypatch.setattr(serve, "cluster_from_args", no_cluster)
    for extra in (["--longest-first"], []):
        args = build_parser().parse_args(["rollout", str(tmp_path / "t.jsonl"), "--out", str(tmp_path / "o"), *extra])
        with pytest.raises(RuntimeError, match="no cluster"):
            rollout_main(args)
    assert seen == [("priority", True), ("fcfs", False)]


def test_resume_refuses_results_of_other_trajectories(tmp_path):
    ts, _ = generate_trace("64k", 3, scale=0.02, turns_scale=0.05, vocab=(3, 250), seed=1)
    other, _ = generate_trace("64k", 3, scale=0.02, turns_scale=0.05, vocab=(3, 250), seed=2)
    agents = make_agents(ts, RolloutConfig())
    digests = {a.id: agent_digest(a) for a in agents}
    out = tmp_path / "out.jsonl"
    lines = [
        {"agent": a.id, "round": i, "rounds": len(a.rounds), "digest": digests[a.id]}
        for a in agents
        for i in range(len(a.rounds))
    ]
    out.write_text("".join(json.dumps(r) + "\n" for r in lines[:-1]) + '{"agent": "cut sh')
    done, kept = completed_agents(out, digests)
    assert done == {a.id for a in agents[:-1]} and len(kept) == len(lines) - len(agents[-1].rounds)
    stale = {a.id: agent_digest(a) for a in make_agents(other, RolloutConfig())}  # same ids, other rounds
    with pytest.raises(DualPathError, match="out.jsonl:1: results of agent agent-0 come from other rounds"):
        completed_agents(out, stale)
    assert agent_digest(make_agents(ts, RolloutConfig(agents=4, seed=1))[0]) != agent_digest(
        make_agents(ts, RolloutConfig(agents=4, seed=2))[0]
    )


def test_a_group_samples_its_first_round_in_one_request_and_each_sample_goes_on(cluster, tmp_path):
    """GRPO's groups: sample s's first round is choice s of one request (what a request of its own with seed + s
    samples), the later rounds are the sample's own, and every sample's second round finds the shared prompt's
    blocks stored."""
    ts, _ = generate_trace("64k", 2, scale=0.02, turns_scale=0.05, vocab=(3, 250), seed=4)
    cfg = RolloutConfig(temperature=0.9, group_size=3)
    client = ClusterClient(cluster.scheduler_address)
    before = client.stats()["submitted"]
    summary = Rollout(client, cfg).run(ts, tmp_path / "out.jsonl", progress=False)
    assert client.stats()["submitted"] - before == sum(1 + 3 * (len(t.rounds) - 1) for t in ts)
    recs = {
        (r["agent"], r["sample"], r["round"]): r
        for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())
    }
    assert len(recs) == summary["rounds"] == 3 * sum(len(t.rounds) for t in ts)
    for t in ts:
        first = [recs[(t.id, s, 0)]["output"] for s in range(3)]
        assert len({tuple(o) for o in first}) > 1  # the samples differ
        seed = round_seed(cfg, t.id, 0, 0)
        for s in range(3):
            alone = client.generate(
                list(t.rounds[0].append),
                SamplingParams(max_tokens=t.rounds[0].generate, ignore_eos=True, temperature=0.9, seed=seed + s),
            )
            assert first[s] == alone.token_ids
            second = recs[(t.id, s, 1)]
            assert second["prompt_tokens"] == len(t.rounds[0].append) + len(first[s]) + len(t.rounds[1].append)
            assert second["cached_tokens"] >= len(t.rounds[0].append) // 16 * 16
            assert all(len(recs[(t.id, s, i)]["output"]) == r.generate for i, r in enumerate(t.rounds))
    client.close()


def test_a_group_resumes_only_whole_and_bad_groups_are_refused(tmp_path):
    ts, _ = generate_trace("64k", 2, scale=0.02, turns_scale=0.05, vocab=(3, 250), seed=1)
    cfg = RolloutConfig(temperature=1.0, group_size=2)
    agents = make_agents(ts, cfg)
    digests = {a.id: agent_digest(a, cfg) for a in agents}
    assert digests != {a.id: agent_digest(a) for a in agents}  # greedy single-sample results are not resumed from
    lines = [
        {"agent": a.id, "sample": s, "samples": 2, "round": i, "rounds": len(a.rounds), "digest": digests[a.id]}
        for a in agents
        for s in range(2)
        for i in range(len(a.rounds))
    ]
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in lines[:-1]))  # the last sample lacks its last round
    done, kept = completed_agents(out, digests)
    assert done == {agents[0].id} and len(kept) == 2 * len(agents[0].rounds)
    for bad, message in ((dict(group_size=2), "temperature > 0"), (dict(temperature=1.0, group_size=17), "1..16")):
        with pytest.raises(DualPathError, match=message):
            RolloutConfig(**bad)


@pytest.mark.slow  # ~14 s: two systems' clusters; the serving benchmarks' short runs are slow tests too
def test_agentic_bench_runs_each_system_on_the_same_trace(tiny_dirs, tmp_path):
    """The harness, small: every system replays the same rounds with the same outputs (greedy, forced lengths),
    only the capped systems are capped, and the JSON and figures are written."""
    from dualpath.rollout.agentic import AgenticConfig, run

    cfg = AgenticConfig(
        model=str(tiny_dirs["llama"]),
        agents=3,
        scale=0.03,
        turns_scale=0.05,
        block_size=16,
        systems=("basic", "oracle"),
    )  # a capped and an uncapped system (dualpath: test_cluster)
    result = run(cfg, tmp_path)
    rows = {r["system"]: r for r in result["systems"]}
    assert set(rows) == {"basic", "oracle"} and result["cap_bps"] > 0
    assert rows["oracle"]["storage_read_bps_cap"] == 0 and rows["basic"]["storage_read_bps_cap"] == result["cap_bps"]
    assert rows["basic"]["paths"].keys() == {"pe"} and rows["basic"]["hit_rate"] > 0
    outputs = {
        s: sorted(
            (json.loads(l)["agent"], json.loads(l)["round"], tuple(json.loads(l)["output"]))
            for l in open(tmp_path / f"rounds-{s}.jsonl")
        )
        for s in rows
    }
    assert outputs["basic"] == outputs["oracle"]
    saved = json.loads((tmp_path / "agentic.json").read_text())
    assert [r["system"] for r in saved["systems"]] == ["basic", "oracle"]
    assert all((tmp_path / f).stat().st_size > 0 for f in ("agentic_jct.png", "agentic_storage.png"))
