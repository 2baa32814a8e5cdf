"""Tool gaps in traces: ``Round.tool_s`` in the trajectory format (parsed, checked, written), the generator's
log-normal gaps (median and p90 as asked, the trace's Table 2 shape untouched) and ``dualpath trace``'s flags."""

import json
import math

import numpy as np
import pytest

from dualpath.cli import main
from dualpath.core.errors import ConfigError
from dualpath.rollout.tracegen import (
    CODING_AGENT_TOOL_GAP,
    TOOL_GAP_P90_OVER_MEDIAN,
    draw_tool_gaps,
    generate_trace,
    measure,
    tool_gap_sigma,
    with_tool_gaps,
)
from dualpath.rollout.trajectory import TrajectoryError, read_trajectories, write_trajectories


def line(**round_fields) -> str:
    return json.dumps({"id": "x", "rounds": [{"append": [1], "generate": 1, **round_fields}]})


@pytest.mark.parametrize("value, want", [(2.5, 2.5), (0, 0.0), (3, 3.0), (None, None)])
def test_tool_s_is_read_and_written_back(tmp_path, value, want):
    path = tmp_path / "t.jsonl"
    path.write_text(line(tool_s=value) + "\n")
    (t,) = read_trajectories(path)
    assert t.rounds[0].tool_s == want
    write_trajectories(tmp_path / "u.jsonl", [t])
    (u,) = read_trajectories(tmp_path / "u.jsonl")
    assert u == t
    assert ("tool_s" in (tmp_path / "u.jsonl").read_text()) == (want is not None)  # None: the field is left out


@pytest.mark.parametrize("text", [line(tool_s=-1), line(tool_s="2"), line(tool_s=True), line(tool_s=[1])])
def test_a_bad_tool_s_is_refused_naming_its_line(tmp_path, text):
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n" + text + "\n")
    with pytest.raises(TrajectoryError, match="line 2: round 0: tool_s must be a non-negative finite number"):
        list(read_trajectories(path))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_tool_s_must_be_finite(tmp_path, literal):
    path = tmp_path / "t.jsonl"
    path.write_text('{"id": "x", "rounds": [{"append": [1], "generate": 1, "tool_s": %s}]}\n' % literal)
    with pytest.raises(TrajectoryError, match="tool_s must be a non-negative finite"):
        list(read_trajectories(path))


def test_unknown_round_fields_are_still_refused(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(line(tool_s=1.0, tool_ms=5) + "\n")
    with pytest.raises(TrajectoryError, match=r"unknown fields \['tool_ms'\]"):
        list(read_trajectories(path))


def test_gapped_traces_are_the_same_traces_with_gaps_of_the_asked_shape():
    plain, target = generate_trace("64k", 300, scale=0.05, turns_scale=0.25, seed=3)
    gaps = {"tool_gap_median_s": 2.0, "tool_gap_p90_s": 20.0}
    gapped, target2 = generate_trace("64k", 300, scale=0.05, turns_scale=0.25, seed=3, **gaps)
    assert target == target2
    for p, g in zip(plain, gapped):
        assert [(r.append, r.generate) for r in p.rounds] == [(r.append, r.generate) for r in g.rounds]
        assert all(r.tool_s is None for r in p.rounds)
        assert g.rounds[-1].tool_s is None and all(r.tool_s > 0 for r in g.rounds[:-1])
    st, sp = measure(gapped), measure(plain)
    assert (st.turns, st.append, st.gen, st.context, st.total) == (sp.turns, sp.append, sp.gen, sp.context, sp.total)
    assert sp.tool_gaps == 0 and st.tool_gaps == sum(len(t.rounds) - 1 for t in gapped) > 5000
    assert st.tool_median_s == pytest.approx(2.0, rel=0.08)
    assert st.tool_p90_s == pytest.approx(20.0, rel=0.1)
    sigma = math.log(10) / 1.2815515655446004
    assert st.tool_mean_s == pytest.approx(2.0 * math.exp(sigma**2 / 2), rel=0.15)


def test_gap_shapes_and_their_checks():
    assert tool_gap_sigma(*CODING_AGENT_TOOL_GAP) == pytest.approx(math.log(12) / 1.2815515655446004)
    assert tool_gap_sigma(2.0) == tool_gap_sigma(2.0, 2.0 * TOOL_GAP_P90_OVER_MEDIAN)  # p90 0: the default ratio
    assert tool_gap_sigma(3.0, 3.0) == 0.0  # p90 = median: every gap the median
    for median, p90 in ((0.0, 5.0), (-1.0, 5.0), (5.0, 4.0), (1.0, math.inf), (math.nan, 2.0)):
        with pytest.raises(ConfigError):
            tool_gap_sigma(median, p90)
    assert draw_tool_gaps([3, 1, 0], 0.0) == [[None] * 3, [None], []]
    gaps = draw_tool_gaps([3, 1, 2], 1.0, seed=4)
    assert [len(g) for g in gaps] == [3, 1, 2] and [g[-1] for g in gaps] == [None] * 3
    assert gaps == draw_tool_gaps([3, 1, 2], 1.0, seed=4) != draw_tool_gaps([3, 1, 2], 1.0, seed=5)
    shapes = [[(10, 2), (3, 4)], [(7, 1)]]
    assert with_tool_gaps(shapes, 0.0) == [[(10, 2, 0.0), (3, 4, 0.0)], [(7, 1, 0.0)]]
    (a, b), (c,) = with_tool_gaps(shapes, 1.0, 1.0)
    assert a == (10, 2, pytest.approx(1.0)) and b == (3, 4, 0.0) and c == (7, 1, 0.0)


def test_the_trace_command_writes_gaps_and_reports_them(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    argv = ["trace", "--agents", "40", "--scale", "0.02", "--turns-scale", "0.1", "--out", str(out)]
    assert main([*argv, "--tool-gap-median-s", "1", "--tool-gap-p90-s", "12"]) == 0
    printed = capsys.readouterr().out
    assert "tool gaps:" in printed and "median" in printed
    ts = list(read_trajectories(out))
    gaps = np.array([r.tool_s for t in ts for r in t.rounds[:-1]])
    assert len(gaps) and all(t.rounds[-1].tool_s is None for t in ts) and np.all(gaps > 0)
    assert main(argv) == 0 and "tool gaps" not in capsys.readouterr().out  # the default: none, as the paper
    assert all(r.tool_s is None for t in read_trajectories(out) for r in t.rounds)
    assert main([*argv, "--tool-gap-median-s", "5", "--tool-gap-p90-s", "2"]) == 2
    assert "p90 >= the median" in capsys.readouterr().err
