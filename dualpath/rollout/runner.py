"""Run trajectories against a cluster: every agent issues its next round as soon as the previous one finished
(plus an optional think time), results stream to a JSONL file one round per line, and an interrupted job resumes
from that file without redoing the agents it finished.

A result line: ``{"agent", "trajectory", "round", "rounds", "digest", "prompt_tokens", "cached_tokens",
"completion_tokens", "output", "finish_reason", "ttft", "tpot", "path", "kv_bytes", "start", "end"}`` (times in
seconds since the job started; ``output`` the generated token ids, which RL rollouts need; ``digest`` a fingerprint
of the agent's rounds, so that a resume never mixes in results of other trajectories).
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

from dualpath.client import ClusterClient
from dualpath.errors import DualPathError
from dualpath.rollout.trajectory import Round, Trajectory
from dualpath.sampling_params import SamplingParams

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


def agent_digest(agent: Agent) -> str:
    """A fingerprint of what the agent sends: resuming checks that earlier results came from the same rounds."""
    rounds = [[list(r.append) if not isinstance(r.append, str) else r.append, r.generate, r.max_tokens]
              for r in agent.rounds]
    return hashlib.blake2b(json.dumps(rounds).encode(), digest_size=8).hexdigest()


def completed_agents(path: Path, digests: dict[str, str]) -> tuple[set[str], list[str]]:
    """Agents whose every round is in ``path``, and the result lines that belong to them. ``digests``: each agent's
    :func:`agent_digest`; a line of the same agent with another digest (results of other trajectories, or of
    another ``--agents``/``--seed``) is an error, not something to resume from."""
    if not path.exists():
        return set(), []
    lines, rounds_done, rounds_total = [], {}, {}
    for number, text in enumerate(path.read_text().splitlines(), 1):
        if not text.strip():
            continue
        try:
            rec = json.loads(text)
        except ValueError:
            continue  # a line cut short by the interruption
        if rec["agent"] in digests and rec.get("digest") != digests[rec["agent"]]:
            raise DualPathError(f"{path}:{number}: results of agent {rec['agent']} come from other rounds than "
                                f"these trajectories (another file, --agents or --seed); use a new --out")
        lines.append((rec["agent"], text))
        rounds_done[rec["agent"]] = rounds_done.get(rec["agent"], 0) + 1
        rounds_total[rec["agent"]] = rec["rounds"] if not rec.get("stopped") else rounds_done[rec["agent"]]
    done = {a for a, n in rounds_done.items() if n >= rounds_total[a]}
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

    def _sampling(self, agent: Agent, i: int, r: Round) -> SamplingParams:
        seed = None if self.cfg.temperature == 0 else hash((self.cfg.seed, agent.id, i)) % (2 ** 31)
        if r.forced:
            return SamplingParams(max_tokens=r.generate, ignore_eos=True, temperature=self.cfg.temperature, seed=seed)
        return SamplingParams(max_tokens=r.max_tokens, temperature=self.cfg.temperature, seed=seed)

    def _agent(self, agent: Agent, out, bar) -> None:
        context: list[int] = []
        for i, r in enumerate(agent.rounds):
            context += self._tokens(r.append)
            sampling = self._sampling(agent, i, r)
            if self.cfg.max_model_len and len(context) + sampling.max_tokens > self.cfg.max_model_len:
                log.warning("agent %s stops at round %d: the context would exceed %d tokens", agent.id, i,
                            self.cfg.max_model_len)
                self._write(out, {"agent": agent.id, "trajectory": agent.trajectory, "round": i,
                                  "rounds": len(agent.rounds), "digest": self.digests[agent.id],
                                  "stopped": "context limit"})
                return
            start = time.perf_counter() - self.t0
            res = self.client.generate(context, sampling, mode=self.cfg.mode)
            end = time.perf_counter() - self.t0
            rec = {"agent": agent.id, "trajectory": agent.trajectory, "round": i, "rounds": len(agent.rounds),
                   "digest": self.digests[agent.id], "prompt_tokens": len(context),
                   "cached_tokens": res.num_cached_tokens,
                   "completion_tokens": len(res.token_ids), "output": res.token_ids,
                   "finish_reason": res.finish_reason, "ttft": res.ttft_s, "tpot": res.tpot_s, "path": res.path,
                   "kv_bytes": res.storage_bytes, "start": start, "end": end}
            self._write(out, rec)
            bar.update(1)
            context += res.token_ids
            if self.cfg.think_time_s:
                time.sleep(self.cfg.think_time_s)

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
                self.timeline.append({"t": time.perf_counter() - self.t0,
                                      "storage_read_bytes": stats.get("storage_read_bytes", {})})
            except DualPathError:
                pass
            stop.wait(self.cfg.sample_interval_s)

    def run(self, trajectories: list[Trajectory], out_path: str | Path, progress: bool = True) -> dict:
        out_path = Path(out_path)
        agents = make_agents(trajectories, self.cfg)
        self.digests = {a.id: agent_digest(a) for a in agents}
        done, kept = completed_agents(out_path, self.digests)
        if done:
            log.info("resuming: %d of %d agents already finished", len(done & {a.id for a in agents}), len(agents))
        out_path.write_text("".join(line + "\n" for line in kept))  # drop partial agents: they run again
        todo = [a for a in agents if a.id not in done]
        total_rounds = sum(len(a.rounds) for a in todo)
        stop = threading.Event()
        self.t0 = time.perf_counter()
        before = self._safe_stats()
        sampler = threading.Thread(target=self._sample, args=(stop,), daemon=True)
        sampler.start()
        with open(out_path, "a") as out, tqdm(total=total_rounds, disable=not progress, unit="round",
                                               desc="rollout", smoothing=0.1) as bar:
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

    def _postfix(self, bar, stop: threading.Event) -> None:
        while not stop.wait(1.0):
            with self._lock:
                recs = list(self.records)
            elapsed = max(1e-9, time.perf_counter() - self.t0)
            toks = sum(r["completion_tokens"] for r in recs)
            prompt = sum(r["prompt_tokens"] for r in recs) or 1
            agents_done = len({r["agent"] for r in recs if r["round"] == r["rounds"] - 1})
            bar.set_postfix(agents=agents_done, tok_s=f"{toks / elapsed:.0f}",
                            hit=f"{sum(r['cached_tokens'] for r in recs) / prompt:.2f}", refresh=False)

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
        reads = {n: after.get("storage_read_bytes", {}).get(n, 0) - before.get("storage_read_bytes", {}).get(n, 0)
                 for n in nodes}
        from scheduler.balance import max_over_avg

        return {"agents": n_agents, "agents_run": ran, "rounds": len(recs), "job_completion_time_s": jct,
                "generated_tokens": gen, "prompt_tokens": prompt,
                "throughput_tokens_per_s": (gen + prompt - sum(r["cached_tokens"] for r in recs)) / jct if jct else 0,
                "generated_tokens_per_s": gen / jct if jct else 0.0, "rounds_per_s": len(recs) / jct if jct else 0.0,
                "hit_rate": sum(r["cached_tokens"] for r in recs) / prompt if prompt else 0.0,
                "ttft_p50_s": _pct(recs, "ttft", 50), "ttft_p99_s": _pct(recs, "ttft", 99),
                "tpot_p50_s": _pct(recs, "tpot", 50),
                "storage_read_bytes_per_node": reads, "storage_read_max_over_avg": max_over_avg(reads.values()),
                "paths": {p: sum(1 for r in recs if r["path"] == p) for p in sorted({r["path"] for r in recs})},
                "timeline": self.timeline}


def _pct(recs: list[dict], key: str, q: int) -> float:
    values = sorted(r[key] for r in recs)
    if not values:
        return 0.0
    if q == 50:
        return statistics.median(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]
