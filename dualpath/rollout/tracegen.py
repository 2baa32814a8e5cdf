"""Synthetic agentic traces shaped like the paper's coding-agent traces (Table 2, ``shared/paper-notes.md`` §6).

Table 2's columns are per-turn averages (each turn weighs the same): *turns* is the round count of the trajectory a
turn belongs to, *append*/*gen* the tokens a round appends/generates, *context* a round's prompt length and *total*
the final length of the turn's trajectory. Read that way the table is consistent: trajectories end near MaxLen
(64K: total 55,958 = 0.85 x 65,536), a trajectory's rounds number total / (append + gen) on average (64K: 92) and
the size-biased mean of 157 says how widely they spread (a gamma of shape ~1.4), and a context of 0.58 x total says
growth is front-loaded (a large first round: the system prompt and task). Matching all five together, with no
trajectory past MaxLen, keeps a trace's tail as the paper's: a long trajectory grows slowly, not past the limit.

How: per trajectory a final length uniform on [MaxLen x (1 - w), MaxLen] (mean = total), a gamma number of rounds
with the mean and size-biased mean above, log-normal generation sizes (shrunk where many rounds would not leave
room for appends), and appends that fill the rest with weights ``(p + 1) x^p`` of the trajectory's progress x
(p < 0 front-loads), ``p`` solved for so that the mean context matches. ``scale`` multiplies the token counts and
``turns_scale`` the number of rounds, for machines smaller than the paper's.

**Tool gaps.** The paper replays its traces with no time between turns (``shared/paper-notes.md`` §8). With
``tool_gap_median_s`` > 0 every round but a trajectory's last is followed by a tool call (``Round.tool_s``: the gap
before the next round is sent) whose duration is log-normal with that median and ``tool_gap_p90_s`` as its 90th
percentile (``sigma = ln(p90 / median) / 1.2816``; p90 0: ``TOOL_GAP_P90_OVER_MEDIAN`` x the median). The gaps are
drawn from their own random stream: a trace's rounds and token ids are the same with or without them.

Suggested values for coding agents, ``CODING_AGENT_TOOL_GAP`` = median 1 s, p90 12 s (mean 6.5 s, p99 ~90 s). The
mean is near a measured one, the shape is our estimate. SyFI TraceLab (University of Washington,
tracelab.cs.washington.edu; a public pool of 357,161 agent steps from Claude Code and Codex sessions), table "Codex
tool end-to-end vs internal latency": 253k timed Codex tool calls took 418.1 h end to end, a mean of 5.9 s per call;
shell commands (``exec_command``, 184k calls, 97.8 h) 1.9 s on average, interactive long-running processes
(``write_stdin``, such as test runs and builds; 61k calls, 314.6 h) 18.6 s, patches (``apply_patch``) well under a
second. So most calls (edits, reads, short commands) take about a second and a tenth of them (test runs, builds)
tens of seconds: a median of 1 s with a p90 of 12 s gives a mean of 6.5 s, near the measured 5.9 s. The median and
p90 are our estimate (the table gives means per tool, not per-call percentiles); harness overhead moves them (a
Claude Code ``Bash`` call of ``echo hello`` took ~3.4 s end to end in a 5-run OpenTelemetry measurement), so measure
your own agents' gaps where you can.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from dualpath.core.errors import ConfigError
from dualpath.rollout.trajectory import Round, Trajectory

#: Table 2: total / MaxLen for its three sets (0.87, 0.87, 0.85); MaxLen for explicit stats that name none.
TOTAL_OVER_MAXLEN = 0.86
#: Generated tokens take at most this share of a trajectory (rounds of very long trajectories generate less).
MAX_GEN_SHARE = 0.6
#: Tool gaps of coding agents, (median, p90) seconds: see the module docstring for the sources and the estimate.
CODING_AGENT_TOOL_GAP = (1.0, 12.0)
#: A tool gap's p90 when only its median is given (the ratio of ``CODING_AGENT_TOOL_GAP``).
TOOL_GAP_P90_OVER_MEDIAN = CODING_AGENT_TOOL_GAP[1] / CODING_AGENT_TOOL_GAP[0]
Z90 = 1.2815515655446004  # the standard normal's 90th percentile
_GAP_STREAM = 0x7001  # tool gaps draw from their own stream of the seed: the trace stays as it is without them


@dataclass(frozen=True)
class TraceStats:
    """Per-turn averages (see the module docstring); ``max_len`` bounds every trajectory's final length."""

    turns: float
    append: float
    gen: float
    context: float
    total: float
    max_len: float | None = None
    # tool gaps (``Round.tool_s``): how many rounds are followed by one, and their median, p90 and mean in seconds
    tool_gaps: int = 0
    tool_median_s: float = 0.0
    tool_p90_s: float = 0.0
    tool_mean_s: float = 0.0

    def scaled(self, scale: float, turns_scale: float = 1.0) -> "TraceStats":
        tokens = scale * turns_scale  # a trajectory's length: tokens per round x rounds
        return replace(
            self,
            turns=self.turns * turns_scale,
            append=self.append * scale,
            gen=self.gen * scale,
            context=self.context * tokens,
            total=self.total * tokens,
            max_len=self.limit * tokens,
        )

    @property
    def limit(self) -> float:
        return self.max_len if self.max_len else self.total / TOTAL_OVER_MAXLEN


PRESETS = {  # the paper's Table 2
    "32k": TraceStats(turns=60, append=608, gen=148, context=17_183, total=28_639, max_len=32_768),
    "48k": TraceStats(turns=106, append=474, gen=172, context=25_120, total=42_607, max_len=49_152),
    "64k": TraceStats(turns=157, append=429, gen=176, context=32_721, total=55_958, max_len=65_536),
}


def measure(trajectories: list[Trajectory]) -> TraceStats:
    """The statistics of a trace (appends given as token ids), per-turn averages as Table 2's, and its tool gaps'."""
    st = measure_shapes([[(len(r.append), r.generate or r.max_tokens) for r in t.rounds] for t in trajectories])
    gaps = np.array([r.tool_s for t in trajectories for r in t.rounds if r.tool_s is not None], dtype=np.float64)
    if not len(gaps):
        return st
    median, p90 = np.quantile(gaps, [0.5, 0.9])
    return replace(
        st, tool_gaps=len(gaps), tool_median_s=float(median), tool_p90_s=float(p90), tool_mean_s=float(gaps.mean())
    )


def tool_gap_sigma(median_s: float, p90_s: float = 0.0) -> float:
    """The log-normal sigma of tool gaps with this median and p90 (p90 0: ``TOOL_GAP_P90_OVER_MEDIAN`` x the
    median); ``ConfigError`` unless 0 < median <= p90, all finite."""
    p90_s = p90_s or TOOL_GAP_P90_OVER_MEDIAN * median_s
    if not (0 < median_s <= p90_s < np.inf):
        raise ConfigError(
            f"tool gaps need a median > 0 and a p90 >= the median, finite; got median {median_s!r}, p90 {p90_s!r}"
        )
    return float(np.log(p90_s / median_s) / Z90)


def draw_tool_gaps(rounds: list[int], median_s: float, p90_s: float = 0.0, seed: int = 0) -> list[list[float | None]]:
    """Per trajectory of ``rounds[i]`` rounds, the tool gap after each round (seconds; the last round's None):
    log-normal with ``median_s`` and ``p90_s`` (``tool_gap_sigma``). ``median_s`` 0: no gaps (all None), as the
    paper's traces. Drawn from the seed's own stream, so the trace's other draws do not move."""
    if median_s == 0 and not p90_s:
        return [[None] * n for n in rounds]
    sigma = tool_gap_sigma(median_s, p90_s)
    rng = np.random.default_rng((seed, _GAP_STREAM))
    draws = (median_s * np.exp(sigma * rng.standard_normal(max(0, sum(rounds) - len(rounds))))).tolist()
    out, k = [], 0
    for n in rounds:
        out.append([*draws[k : k + n - 1], None] if n else [])
        k += max(0, n - 1)
    return out


def with_tool_gaps(
    shapes: list[list[tuple[int, int]]], median_s: float, p90_s: float = 0.0, seed: int = 0
) -> list[list[tuple[int, int, float]]]:
    """``trace_shapes``' rounds as (appended, generated, tool gap after it) for the simulator (0.0: no gap)."""
    gaps = draw_tool_gaps([len(rs) for rs in shapes], median_s, p90_s, seed)
    return [[(a, g, t or 0.0) for (a, g), t in zip(rs, ts)] for rs, ts in zip(shapes, gaps)]


def measure_shapes(shapes: list[list[tuple[int, int]]]) -> TraceStats:
    """:func:`measure` over lengths only: per trajectory, its rounds as (appended, generated) tokens."""
    rounds = turns = append = gen = context = total = 0
    longest = 0
    for rs in shapes:
        a = np.array([x for x, _ in rs], dtype=np.int64)
        g = np.array([y for _, y in rs], dtype=np.int64)
        prompt = np.cumsum(a) + np.concatenate([[0], np.cumsum(g)[:-1]])
        n, final = len(rs), int(a.sum() + g.sum())
        rounds, turns, append, gen = rounds + n, turns + n * n, append + a.sum(), gen + g.sum()
        context, total, longest = context + prompt.sum(), total + n * final, max(longest, final)
    k = max(1, rounds)
    return TraceStats(turns / k, append / k, gen / k, context / k, total / k, longest)


@dataclass(frozen=True)
class _Draws:
    """A trace's random draws, flat over every round of every trajectory (``start[i]`` = trajectory i's first)."""

    rounds: np.ndarray  # per trajectory
    final: np.ndarray  # per trajectory: the length it should end at
    unit: np.ndarray  # per round: generation size / the mean
    noise: np.ndarray  # per round: append weight noise
    start: np.ndarray  # per trajectory
    owner: np.ndarray  # per round: its trajectory


def _draw(target: TraceStats, n: int, rng: np.random.Generator) -> tuple[_Draws, np.ndarray]:
    """The draws and the generation sizes."""
    limit = target.limit
    w = min(1.0, max(0.0, 2 * (1 - target.total / limit)))  # final ~ U[limit(1 - w), limit]: mean = total
    final = np.floor(limit * (1 - w * rng.random(n)))
    mean = target.total / (target.append + target.gen)  # rounds per trajectory; turns is its size-biased mean
    shape = mean / (target.turns - mean) if target.turns > mean * 1.001 else 1e3
    spread, most, want = rng.gamma(shape, 1 / shape, n), np.maximum(2, final // 2).astype(np.int64), mean
    for _ in range(6):  # rounding and the bounds move the mean: keep it at total / (append + gen)
        rounds = np.clip(np.round(spread * mean), 2, most).astype(np.int64)
        mean *= want / rounds.mean()
    start = np.concatenate([[0], np.cumsum(rounds)[:-1]])
    unit = rng.lognormal(-0.08, 0.4, int(rounds.sum()))  # x the mean generation size
    noise = rng.lognormal(-0.18, 0.6, int(rounds.sum()))
    d, size = _Draws(rounds, final, unit, noise, start, np.repeat(np.arange(n), rounds)), target.gen
    for _ in range(4):  # shrinking crowded trajectories lowers the mean: raise the others' to compensate
        size *= target.gen / max(1e-9, _gens(d, size).mean())
    return d, _gens(d, size)


def _gens(d: _Draws, size: float) -> np.ndarray:
    gens = d.unit * size
    room = MAX_GEN_SHARE * d.final / np.maximum(1e-9, np.add.reduceat(gens, d.start))
    return np.maximum(1, np.round(gens * np.minimum(1.0, room)[d.owner])).astype(np.int64)


def _appends(d: _Draws, gens: np.ndarray, p: float) -> np.ndarray:
    owner = d.owner
    x = (np.arange(len(owner)) - d.start[owner] + 0.5) / d.rounds[owner]
    raw = (p + 1) * x**p * d.noise
    budget = np.maximum(d.rounds, d.final - np.add.reduceat(gens, d.start))
    a = np.maximum(1, np.round(raw * (budget / np.add.reduceat(raw, d.start))[owner])).astype(np.int64)
    over = np.add.reduceat(a, d.start) + np.add.reduceat(gens, d.start) - np.maximum(d.final, 2 * d.rounds)
    a[d.start] = np.maximum(1, a[d.start] - np.maximum(0, over))  # rounded past the limit: the first round gives back
    return a


def _mean_context(d: _Draws, gens: np.ndarray, appends: np.ndarray) -> float:
    grown = np.cumsum(appends) + np.cumsum(gens) - gens  # before each round's generation
    base = (grown - appends)[d.start]  # what earlier trajectories left in the running sums
    return float((grown - base[d.owner]).mean())


def trace_shapes(
    preset: str | TraceStats,
    agents: int,
    scale: float = 1.0,
    turns_scale: float = 1.0,
    rng: np.random.Generator | int = 0,
) -> tuple[list[list[tuple[int, int]]], TraceStats]:
    """Per agent, its rounds as (appended tokens, generated tokens), matching ``preset`` (a Table 2 name or explicit
    stats); and the (scaled) target. Lengths only: what a simulator needs, at any number of agents."""
    base = PRESETS[preset] if isinstance(preset, str) else preset
    target = base.scaled(scale, turns_scale)
    rng = np.random.default_rng(rng) if isinstance(rng, int) else rng
    d, gens = _draw(target, agents, rng)
    lo, hi = -0.95, 8.0  # mean context falls as p grows
    for _ in range(40):
        mid = (lo + hi) / 2
        if _mean_context(d, gens, _appends(d, gens, mid)) > target.context:
            lo = mid
        else:
            hi = mid
    a, g = _appends(d, gens, (lo + hi) / 2).tolist(), gens.tolist()
    return [list(zip(a[s : s + n], g[s : s + n])) for s, n in zip(d.start.tolist(), d.rounds.tolist())], target


def generate_trace(
    preset: str | TraceStats,
    agents: int,
    scale: float = 1.0,
    turns_scale: float = 1.0,
    vocab: tuple[int, int] = (1000, 32000),
    seed: int = 0,
    tool_gap_median_s: float = 0.0,
    tool_gap_p90_s: float = 0.0,
) -> tuple[list[Trajectory], TraceStats]:
    """``agents`` trajectories matching ``preset`` (a Table 2 name or explicit stats), token ids drawn at random;
    returns them and the (scaled) target. ``tool_gap_median_s`` > 0: a log-normal tool gap after every round but
    each trajectory's last (``draw_tool_gaps``; ``CODING_AGENT_TOOL_GAP`` suggests values); 0: none, as the paper."""
    if tool_gap_median_s or tool_gap_p90_s:
        tool_gap_sigma(tool_gap_median_s, tool_gap_p90_s)  # refuse bad values before the trace is drawn
    rng = np.random.default_rng(seed)
    shapes, target = trace_shapes(preset, agents, scale, turns_scale, rng)
    gaps = draw_tool_gaps([len(rs) for rs in shapes], tool_gap_median_s, tool_gap_p90_s, seed)
    trajectories = []
    for i, (rounds, tools) in enumerate(zip(shapes, gaps)):
        rs = tuple(
            Round(tuple(rng.integers(vocab[0], vocab[1], int(k)).tolist()), generate=int(g), tool_s=t)
            for (k, g), t in zip(rounds, tools)
        )
        trajectories.append(Trajectory(f"agent-{i}", rs))
    return trajectories, target
