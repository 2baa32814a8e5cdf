"""Synthetic agentic traces shaped like the paper's coding-agent traces (Table 2, ``shared/paper-notes.md`` §6).

Matched statistics (means): rounds per trajectory (*turns*), appended tokens per round (*append*), generated
tokens per round (*gen*) and prompt length per round (*context*). ``scale`` multiplies the token counts and
``turns_scale`` the number of rounds, for machines smaller than the paper's. Rounds are forced-length replays.

How: rounds per trajectory are gamma-distributed around the target; generation and append sizes are log-normal
around theirs; appends grow along a trajectory as ``(p + 1) x^p`` of the trajectory's progress x, and ``p`` is
solved for so that the mean context matches (agents' contexts grow slowly at first — small edits — then fast,
as tool outputs pile up). The paper's *Total* column is reported beside what is generated but not matched: with
every turn extending the previous one, no trace can show its turns, append, gen and context together with that
total (e.g. 64K: 157 turns × 605 tokens per turn already exceed the 64K limit).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dualpath.rollout.trajectory import Round, Trajectory


@dataclass(frozen=True)
class TraceStats:
    turns: float
    append: float
    gen: float
    context: float
    total: float

    def scaled(self, scale: float, turns_scale: float = 1.0) -> "TraceStats":
        return TraceStats(self.turns * turns_scale, self.append * scale, self.gen * scale,
                          self.context * scale * turns_scale, self.total * scale * turns_scale)


PRESETS = {  # the paper's Table 2
    "32k": TraceStats(turns=60, append=608, gen=148, context=17_183, total=28_639),
    "48k": TraceStats(turns=106, append=474, gen=172, context=25_120, total=42_607),
    "64k": TraceStats(turns=157, append=429, gen=176, context=32_721, total=55_958),
}


def measure(trajectories: list[Trajectory]) -> TraceStats:
    """The statistics of a trace (appends given as token ids)."""
    rounds = turns = append = gen = context = total = 0
    for t in trajectories:
        ctx = 0
        for r in t.rounds:
            ctx += len(r.append)
            context += ctx
            append += len(r.append)
            g = r.generate or r.max_tokens
            gen += g
            ctx += g
            rounds += 1
        total += ctx
        turns += len(t.rounds)
    n = max(1, len(trajectories))
    return TraceStats(turns / n, append / max(1, rounds), gen / max(1, rounds), context / max(1, rounds), total / n)


def _shape(target: TraceStats, n: int, rng: np.random.Generator):
    """Per trajectory: number of rounds, generation sizes and the unshaped append noise."""
    out = []
    for _ in range(n):
        rounds = max(2, int(round(rng.gamma(4.0, target.turns / 4.0))))
        gens = np.maximum(1, np.round(rng.lognormal(np.log(target.gen) - 0.08, 0.4, rounds))).astype(int)
        noise = rng.lognormal(-0.18, 0.6, rounds)
        out.append((rounds, gens, noise))
    return out


def _appends(rounds: int, noise: np.ndarray, mean: float, p: float) -> np.ndarray:
    x = (np.arange(rounds) + 0.5) / rounds
    weight = (p + 1) * x ** p
    raw = weight * noise
    return np.maximum(1, np.round(raw * mean * rounds / raw.sum())).astype(int)


def _mean_context(shapes, target: TraceStats, p: float) -> float:
    total = count = 0
    for rounds, gens, noise in shapes:
        a = _appends(rounds, noise, target.append, p)
        prompt = np.cumsum(a) + np.concatenate([[0], np.cumsum(gens)[:-1]])
        total += prompt.sum()
        count += rounds
    return total / count


def trace_shapes(preset: str | TraceStats, agents: int, scale: float = 1.0, turns_scale: float = 1.0,
                 rng: np.random.Generator | int = 0) -> tuple[list[list[tuple[int, int]]], TraceStats]:
    """Per agent, its rounds as (appended tokens, generated tokens), matching ``preset`` (a Table 2 name or explicit
    stats); and the (scaled) target. Lengths only: what a simulator needs, at any number of agents."""
    base = PRESETS[preset] if isinstance(preset, str) else preset
    target = base.scaled(scale, turns_scale)
    rng = np.random.default_rng(rng) if isinstance(rng, int) else rng
    shapes = _shape(target, agents, rng)
    lo, hi = 0.0, 8.0  # mean context falls as p grows
    for _ in range(40):
        mid = (lo + hi) / 2
        if _mean_context(shapes, target, mid) > target.context:
            lo = mid
        else:
            hi = mid
    p = (lo + hi) / 2
    return [list(zip(_appends(rounds, noise, target.append, p).tolist(), gens.tolist()))
            for rounds, gens, noise in shapes], target


def generate_trace(preset: str | TraceStats, agents: int, scale: float = 1.0, turns_scale: float = 1.0,
                   vocab: tuple[int, int] = (1000, 32000), seed: int = 0) -> tuple[list[Trajectory], TraceStats]:
    """``agents`` trajectories matching ``preset`` (a Table 2 name or explicit stats), token ids drawn at random;
    returns them and the (scaled) target."""
    rng = np.random.default_rng(seed)
    shapes, target = trace_shapes(preset, agents, scale, turns_scale, rng)
    trajectories = []
    for i, rounds in enumerate(shapes):
        rs = tuple(Round(tuple(rng.integers(vocab[0], vocab[1], int(k)).tolist()), generate=int(g))
                   for k, g in rounds)
        trajectories.append(Trajectory(f"agent-{i}", rs))
    return trajectories, target
