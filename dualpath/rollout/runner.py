"""Run trajectories against a cluster: every agent issues its next round as soon as the previous one finished
(plus an optional think time), results stream to a JSONL file one round per line, and an interrupted job resumes
from that file without redoing the agents it finished.

A result line: ``{"agent", "trajectory", "sample", "samples", "round", "rounds", "digest", "prompt_tokens",
"cached_tokens", "completion_tokens", "output", "finish_reason", "ttft", "tpot", "path", "kv_bytes", "start",
"end"}`` (times in seconds since the job started; ``output`` the generated token ids, which RL rollouts need;
``digest`` a fingerprint of the agent's rounds and sampling, so that a resume never mixes in results of other
trajectories). With ``group_size`` G > 1 every agent is sampled G times (GRPO's groups): its first round is one
request with n = G, so the prompt is loaded or computed once, and each sample continues on its own from there
(``sample`` 0..G-1); the first round's ``kv_bytes`` are on sample 0's line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from dualpath.client import ClusterClient, GenerationResult
from dualpath.core.errors import DualPathError
from dualpath.rollout.trajectory import Round, Trajectory
from dualpath.core.sampling_params import MAX_CHOICES, SamplingParams
from dualpath.core.sessions import SessionHint

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutConfig:
    think_time_s: float = 0.0
    temperature: float = 0.0
    seed: int = 0
    agents: int | None = None  # replicate trajectories into this many agents (each with a random first round)
    first_round_tokens: int = 64  # length of that random first round
    vocab: tuple[int, int] = (1000, 32000)  # token ids the random first rounds draw from
    max_concurrency: int | None = None  # agents in flight at once (default: all)
    mode: str = ""  # read-path mode for every request ("" = the scheduler's)
    max_model_len: int = 0  # rounds that would overflow it end their agent early (0: no check here)
    sample_interval_s: float = 0.5  # scheduler statistics sampling (storage reads per node over time)
    group_size: int = 1  # samples per agent: one first-round request with n = group_size, then each on its own
    # Agents with the most rounds left go first: each round's priority is minus the agent's rounds still to run
    # (this one included), and agents start in that order under max_concurrency. The job ends when its longest agent
    # does, so serving the stragglers first shortens it (bench/priority.py's offline part, simulated: 0.69-0.73x
    # the JCT). Needs a scheduler run with --scheduling-policy priority; the results are the same.
    longest_first: bool = False
    adapter: str = ""  # every round runs under this LoRA adapter (its identity, SamplingParams.adapter); "": the base
    # each agent sample is an agent session (dualpath.core.sessions): its next round is expected after the round's
    # tool call (``Round.tool_s``), and the scheduler may prefetch its KV meanwhile; off: anonymous requests
    sessions: bool = True
    tool_hints: bool = False  # tell the scheduler each round's tool time (next_turn_in_s) instead of letting it learn

    def __post_init__(self):
        if not 1 <= self.group_size <= MAX_CHOICES:
            raise DualPathError(f"group size must be 1..{MAX_CHOICES}, got {self.group_size}")
        if self.group_size > 1 and self.temperature == 0:
            raise DualPathError("a group of samples needs a temperature > 0 (greedy samples are all the same)")


@dataclass(frozen=True)
class Agent:
    id: str
    trajectory: str
    rounds: tuple[Round, ...]


def make_agents(trajectories: list[Trajectory], cfg: RolloutConfig) -> list[Agent]:
    """One agent per trajectory, or ``cfg.agents`` copies cycling through them, each copy starting with a random
    round (generation 1) so that no two copies share a prefix — as the paper replicates its traces."""
    if cfg.agents is None:
        return [Agent(t.id, t.id, t.rounds) for t in trajectories]
    rng = random.Random(cfg.seed)
    out = []
    for k in range(cfg.agents):
        t = trajectories[k % len(trajectories)]
        prefix = Round(tuple(rng.randrange(*cfg.vocab) for _ in range(cfg.first_round_tokens)), generate=1)
        out.append(Agent(f"{t.id}#{k}", t.id, (prefix, *t.rounds)))
    return out


def agent_digest(agent: Agent, cfg: RolloutConfig = RolloutConfig()) -> str:
    """A fingerprint of what the agent sends and how it samples: resuming checks that earlier results came from the
    same rounds, temperature, seed, group size and LoRA adapter."""
    rounds = [
        [list(r.append) if not isinstance(r.append, str) else r.append, r.generate, r.max_tokens] for r in agent.rounds
    ]
    if cfg.temperature or cfg.group_size > 1:  # greedy single samples keep the digest they always had
        rounds.append([cfg.temperature, cfg.seed, cfg.group_size])
    if cfg.adapter:
        rounds.append(["adapter", cfg.adapter])
    return hashlib.blake2b(json.dumps(rounds).encode(), digest_size=8).hexdigest()


def round_seed(cfg: RolloutConfig, agent: str, sample: int, i: int) -> int | None:
    """The seed of an agent's sample's round i: the same in every process (``hash()`` of a str is salted per
    interpreter, so a resumed job would have sampled other tokens). Below 2**30: a group's choices add their index."""
    if cfg.temperature == 0:
        return None
    key = json.dumps([cfg.seed, agent, sample, i]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") >> 2


def completed_agents(path: Path, digests: dict[str, str]) -> tuple[set[str], list[str]]:
    """Agents whose every sample's every round is in ``path``, and the result lines that belong to them.
    ``digests``: each agent's :func:`agent_digest`; a line of the same agent with another digest (results of other
    trajectories, or of another ``--agents``/``--seed``/...) is an error, not something to resume from. A group is
    done only whole: its samples share their first round, so a partial group runs again from there."""
    if not path.exists():
        return set(), []
    lines, rounds_done, rounds_total, samples = [], {}, {}, {}
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except ValueError:
            continue  # a line cut short by the interruption
        agent, key = rec["agent"], (rec["agent"], rec.get("sample", 0))
        if agent in digests and rec.get("digest") != digests[agent]:
            raise DualPathError(
                f"{path}:{number}: results of agent {agent} come from other rounds or sampling than "
                f"these (another file, --agents, --seed, --temperature or --group-size); use a new "
                f"--out"
            )
        lines.append((agent, text))
        samples[agent] = rec.get("samples", 1)
        rounds_done[key] = rounds_done.get(key, 0) + 1
        rounds_total[key] = rec["rounds"] if not rec.get("stopped") else rounds_done[key]
    done = {
        a
        for a, g in samples.items()
        if all(rounds_done.get((a, s), 0) >= rounds_total.get((a, s), 1) for s in range(g))
    }
    return done, [t for a, t in lines if a in done]


class Rollout:
    def __init__(self, client: ClusterClient, cfg: RolloutConfig, tokenizer=None):
        self.client, self.cfg, self.tokenizer = client, cfg, tokenizer
        self._lock = threading.Lock()
        self.t0 = 0.0
        self.records: list[dict] = []
        self.timeline: list[dict] = []
        self.digests: dict[str, str] = {}

    def _tokens(self, append) -> list[int]:
        if isinstance(append, str):
            if self.tokenizer is None:
                raise DualPathError("a text round needs the model's tokenizer (pass --model)")
            return self.tokenizer.encode(append, add_special_tokens=False)
        return list(append)

    def _sampling(self, agent: Agent, sample: int, i: int, r: Round, n: int) -> SamplingParams:
        seed = round_seed(self.cfg, agent.id, sample, i)
        priority = i - len(agent.rounds) if self.cfg.longest_first else 0
        if r.forced:
            return SamplingParams(
                max_tokens=r.generate,
                ignore_eos=True,
                temperature=self.cfg.temperature,
                seed=seed,
                n=n,
                priority=priority,
                adapter=self.cfg.adapter,
            )
        return SamplingParams(
            max_tokens=r.max_tokens,
            temperature=self.cfg.temperature,
            seed=seed,
            n=n,
            priority=priority,
            adapter=self.cfg.adapter,
        )

    def _agent(self, agent: Agent, out, bar) -> None:
        """The first round for every sample of the group at once, then each sample's other rounds on its own."""
        context = self._tokens(agent.rounds[0].append)
        firsts = self._round(agent, 0, context, list(range(self.cfg.group_size)), out, bar)
        if firsts is None:
            return
        branches = [context + res.token_ids for res in firsts]
        if len(branches) == 1:
            return self._continue(agent, 0, branches[0], out, bar)
        with ThreadPoolExecutor(len(branches), thread_name_prefix=f"{agent.id}-sample") as pool:
            for f in [pool.submit(self._continue, agent, s, b, out, bar) for s, b in enumerate(branches)]:
                f.result()

    def _continue(self, agent: Agent, sample: int, context: list[int], out, bar) -> None:
        for i in range(1, len(agent.rounds)):
            gap = (agent.rounds[i - 1].tool_s or 0.0) + self.cfg.think_time_s
            if gap:  # the round's tool call runs (the session's KV may be prefetched meanwhile)
                time.sleep(gap)
            context = context + self._tokens(agent.rounds[i].append)
            results = self._round(agent, i, context, [sample], out, bar)
            if results is None:
                return
            context += results[0].token_ids

    def _round(
        self, agent: Agent, i: int, context: list[int], samples: list[int], out, bar
    ) -> list[GenerationResult] | None:
        """Round i of ``samples`` (several only in a group's first round: one request, one choice each); None when
        the context would overflow ``max_model_len`` (those samples stop here)."""
        sampling = self._sampling(agent, samples[0], i, agent.rounds[i], len(samples))
        base = {
            "agent": agent.id,
            "trajectory": agent.trajectory,
            "round": i,
            "rounds": len(agent.rounds),
            "samples": self.cfg.group_size,
            "digest": self.digests[agent.id],
        }
        if self.cfg.max_model_len and len(context) + sampling.max_tokens > self.cfg.max_model_len:
            log.warning(
                "agent %s stops at round %d: the context would exceed %d tokens", agent.id, i, self.cfg.max_model_len
            )
            for s in samples:
                self._write(out, {**base, "sample": s, "stopped": "context limit"})
            return None
        start = time.perf_counter() - self.t0
        results = self.client.generate_choices(
            context,
            sampling,
            mode=self.cfg.mode,
            session=self._session(agent, samples, i),
            tool_wait=i + 1 < len(agent.rounds),
        )
        end = time.perf_counter() - self.t0
        if any(res.finish_reason == "abort" for res in results):  # the round is not what the trace asked for
            raise DualPathError(
                f"agent {agent.id}: round {i} was aborted (a weight update's abort_all_requests); "
                "the agent runs again on resume"
            )
        for s, res in zip(samples, results):
            self._write(
                out,
                {
                    **base,
                    "sample": s,
                    "prompt_tokens": len(context),
                    "cached_tokens": res.num_cached_tokens,
                    "completion_tokens": len(res.token_ids),
                    "output": res.token_ids,
                    "finish_reason": res.finish_reason,
                    "ttft": res.ttft_s,
                    "tpot": res.tpot_s,
                    "path": res.path,
                    "prefetched": res.prefetched,
                    "kv_bytes": res.storage_bytes if s == samples[0] else 0,
                    "start": start,
                    "end": end,
                },
            )
            bar.update(1)
        return results

    def _session(self, agent: Agent, samples: list[int], i: int) -> SessionHint | None:
        """A sample's rounds are one agent session (a group's first round: the first sample's)."""
        if not self.cfg.sessions:
            return None
        hint = agent.rounds[i].tool_s if self.cfg.tool_hints and i + 1 < len(agent.rounds) else None
        return SessionHint(f"{agent.id}/{samples[0]}", next_turn_in_s=hint)

    def _write(self, out, rec: dict) -> None:
        with self._lock:
            out.write(json.dumps(rec) + "\n")
            out.flush()
            if "stopped" not in rec:
                self.records.append(rec)

    def _sample(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                stats = self.client.stats()
                engines = stats.get("engines", {}).values()
                self.timeline.append(
                    {
                        "t": time.perf_counter() - self.t0,
                        "storage_read_bytes": stats.get("storage_read_bytes", {}),
                        # the working set: KV stored (engines of a node share its store: the largest report), and
                        # sessions' KV prefetched into DRAM buffers
                        "storage_used_bytes": max((e.get("storage_used_bytes", 0) for e in engines), default=0),
                        "prefetch_held_bytes": stats.get("prefetch", {}).get("held_bytes", 0),
                    }
                )
            except DualPathError:
                pass  # a missed sample is a gap in the timeline, not a failed job
            stop.wait(self.cfg.sample_interval_s)

    def run(self, trajectories: list[Trajectory], out_path: str | Path, progress: bool = True) -> dict:
        out_path = Path(out_path)
        agents = make_agents(trajectories, self.cfg)
        self.digests = {a.id: agent_digest(a, self.cfg) for a in agents}
        done, kept = completed_agents(out_path, self.digests)
        if done:
            log.info("resuming: %d of %d agents already finished", len(done & {a.id for a in agents}), len(agents))
        out_path.write_text("".join(line + "\n" for line in kept))  # drop partial agents: they run again
        todo = [a for a in agents if a.id not in done]
        if self.cfg.longest_first:
            self._check_priority_scheduling()
            todo.sort(key=lambda a: -len(a.rounds))  # stable: the file's order among equals
        total_rounds = sum(len(a.rounds) for a in todo) * self.cfg.group_size
        stop = threading.Event()
        self.t0 = time.perf_counter()
        before = self._safe_stats()
        sampler = threading.Thread(target=self._sample, args=(stop,), daemon=True)
        sampler.start()
        with (
            open(out_path, "a") as out,
            tqdm(total=total_rounds, disable=not progress, unit="round", desc="rollout", smoothing=0.1) as bar,
        ):
            ticker = threading.Thread(target=self._postfix, args=(bar, stop), daemon=True)
            ticker.start()
            workers = self.cfg.max_concurrency or max(1, len(todo))
            with ThreadPoolExecutor(workers, thread_name_prefix="agent") as pool:
                futures = [pool.submit(self._agent, a, out, bar) for a in todo]
                errors = [f.exception() for f in futures if f.exception() is not None]
        jct = time.perf_counter() - self.t0
        stop.set()
        sampler.join(5)
        summary = self.summary(jct, before, self._safe_stats(), len(agents), len(todo))
        if errors:
            summary["errors"] = [str(e) for e in errors[:10]]
            summary["agents_failed"] = len(errors)
        return summary

    def _check_priority_scheduling(self) -> None:
        """Refuse up front, rather than every agent's first round: the scheduler must order by priority."""
        policy = self.client.stats().get("scheduling_policy", "fcfs")
        if policy != "priority":
            raise DualPathError(
                f"longest-first needs a scheduler run with --scheduling-policy priority (this one: {policy})"
            )

    def _postfix(self, bar, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            with self._lock:
                recs = list(self.records)
            elapsed = max(1e-9, time.perf_counter() - self.t0)
            toks = sum(r["completion_tokens"] for r in recs)
            prompt = sum(r["prompt_tokens"] for r in recs) or 1
            agents_done = len({(r["agent"], r["sample"]) for r in recs if r["round"] == r["rounds"] - 1})
            bar.set_postfix(
                agents=agents_done,
                tok_s=f"{toks / elapsed:.0f}",
                hit=f"{sum(r['cached_tokens'] for r in recs) / prompt:.2f}",
                refresh=False,
            )

    def _safe_stats(self) -> dict:
        try:
            return self.client.stats()
        except DualPathError:
            return {}

    def summary(self, jct: float, before: dict, after: dict, n_agents: int, ran: int) -> dict:
        recs = self.records
        prompt = sum(r["prompt_tokens"] for r in recs)
        gen = sum(r["completion_tokens"] for r in recs)
        nodes = set(after.get("storage_read_bytes", {})) | set(before.get("storage_read_bytes", {}))
        reads = {
            n: after.get("storage_read_bytes", {}).get(n, 0) - before.get("storage_read_bytes", {}).get(n, 0)
            for n in nodes
        }
        from dualpath.scheduler.balance import max_over_avg

        later = [r for r in recs if r["round"] > 0]

        return {
            "agents": n_agents,
            "agents_run": ran,
            "group_size": self.cfg.group_size,
            "rounds": len(recs),
            "job_completion_time_s": jct,
            "generated_tokens": gen,
            "prompt_tokens": prompt,
            "throughput_tokens_per_s": (gen + prompt - sum(r["cached_tokens"] for r in recs)) / jct if jct else 0,
            "generated_tokens_per_s": gen / jct if jct else 0.0,
            "rounds_per_s": len(recs) / jct if jct else 0.0,
            "hit_rate": sum(r["cached_tokens"] for r in recs) / prompt if prompt else 0.0,
            "ttft_p50_s": _pct(recs, "ttft", 50),
            "ttft_p99_s": _pct(recs, "ttft", 99),
            # turns after an agent's first (the ones a session's prefetch can serve), and those that read one
            "ttft_followup_p50_s": _pct(later, "ttft", 50),
            "ttft_followup_p99_s": _pct(later, "ttft", 99),
            "ttft_prefetched_p50_s": _pct([r for r in later if r.get("prefetched")], "ttft", 50),
            "ttft_not_prefetched_p50_s": _pct([r for r in later if not r.get("prefetched")], "ttft", 50),
            "prefetched_rounds": sum(1 for r in later if r.get("prefetched")),
            "prefetch": _delta(before.get("prefetch", {}), after.get("prefetch", {})),
            "storage_read_bytes": sum(reads.values()),
            "tpot_p50_s": _pct(recs, "tpot", 50),
            "storage_read_bytes_per_node": reads,
            "storage_read_max_over_avg": max_over_avg(reads.values()),
            "paths": {p: sum(1 for r in recs if r["path"] == p) for p in sorted({r["path"] for r in recs})},
            "timeline": self.timeline,
        }


def _delta(before: dict, after: dict) -> dict:
    """Counters over the job (gauges such as ``held`` come out as their change)."""
    return {k: v - before.get(k, 0) for k, v in after.items() if isinstance(v, (int, float))}


def _pct(recs: list[dict], key: str, q: int) -> float:
    values = sorted(r[key] for r in recs)
    if not values:
        return 0.0
    if q == 50:
        return statistics.median(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]
