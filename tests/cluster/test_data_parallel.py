"""Data-parallel attention on CPU (gloo): engines in groups that each attend over their own requests and share an
MoE model's routed experts, exchanging tokens in every MoE layer (``dualpath.engines.parallel.dp``).

A cluster of such groups answers as the one-process reference (greedy and sampled; on the prefill engine's read
path, the decode engine's and split between them) whichever engine of a group holds a request while the others
idle or compute their own; the group's balance reaches the scheduler's /metrics; an engine killed mid-reply takes
its group out (the other engine exits 1 within seconds) and the replies move to another group, none lost; bad
groups are refused before anything starts.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest

from dualpath import LLM
from dualpath.client import ClusterClient
from dualpath.core.config import EngineConfig, ParallelConfig
from dualpath.core.errors import ConfigError
from dualpath.launcher import LocalCluster, check_parallelism
from dualpath.engines.models import open_checkpoint
from dualpath.engines.parallel.ranks import check_parallel
from test_cluster import MOVING, assert_as_the_reference, conversation, replies_while, run_conversation, spec


def _run_conversations(client, reference, seeds, mode="dualpath", turns=2) -> list:
    """Conversations at once (so a group's engines hold requests of their own together)."""
    outs: list = []
    threads = [
        threading.Thread(target=lambda s=s: outs.append(run_conversation(client, reference, s, turns, mode)))
        for s in seeds
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outs) == len(seeds), "a conversation hung or failed"
    return outs


# (~20 s each: the slow tier; by default groups form and bad ones are refused below, and the MoE exchange itself runs
# in-process in tests/engines/test_expert_parallel.py)
@pytest.mark.parametrize(
    "arch", [pytest.param("qwen3_moe", marks=pytest.mark.slow), pytest.param("deepseek_v3", marks=pytest.mark.slow)]
)
def test_groups_answer_as_one_process_on_every_read_path(tiny_dirs, tmp_path, arch):
    model = tiny_dirs[arch]
    reference = LLM(str(model), block_size=16)
    with LocalCluster(
        spec(model, tmp_path / "kv", num_prefill=2, num_decode=2, data_parallel_size=2, scheduler_http_port=0),
        run_dir=str(tmp_path / "run"),
    ) as c:
        client = ClusterClient(c.scheduler_address, timeout=120)
        try:
            for mode in ("pe", "de", "split"):  # one request at a time: one engine computes, the other serves
                results = run_conversation(client, reference, seed=50 + len(mode), turns=3, mode=mode)
                assert [got.token_ids for _, got, _ in results] == [want for _, _, want in results], mode
                assert all(got.num_cached_tokens > 0 for _, got, _ in results[1:]), mode
            for results in _run_conversations(client, reference, range(60, 64)):  # both engines compute at once
                assert [got.token_ids for _, got, _ in results] == [want for _, _, want in results]
            deadline = time.monotonic() + 10  # the engines' next reports carry the group's balance
            while time.monotonic() < deadline:
                metrics = urllib.request.urlopen(f"{c.scheduler_http}/metrics", timeout=10).read().decode()
                if 'dualpath_dp_attention_balance{group="decode-dp0"}' in metrics:
                    break
                time.sleep(0.2)
            line = next(m for m in metrics.splitlines() if m.startswith('dualpath_dp_attention_balance{group="decode'))
            assert 1.0 <= float(line.split()[-1]) < 10.0
        finally:
            client.close()
    for name in ("prefill-0", "prefill-1", "decode-0", "decode-1"):
        log = (tmp_path / "run" / f"{name}.log").read_text()
        assert f"is data-parallel rank {name[-1]} of 2" in log


@pytest.mark.slow
def test_an_engine_killed_mid_reply_takes_its_group_out_and_the_replies_move(tiny_dirs, tmp_path):
    """Two decode groups: decode-1 is killed while replies stream; decode-0, its group's other engine, cannot
    compute without its experts and leaves (exit 1, naming the group) within seconds; every reply ends as the
    reference's, moved to the other group."""
    model = tiny_dirs["qwen3_moe"]
    reference = LLM(str(model), block_size=16)
    with LocalCluster(
        spec(model, tmp_path / "kv", num_prefill=2, num_decode=4, data_parallel_size=2, heartbeat_timeout_s=30.0),
        run_dir=str(tmp_path / "run"),
    ) as c:
        moved: list[str] = []
        client = ClusterClient(c.scheduler_address, timeout=60, on_migration=moved.append)
        streaming = threading.Semaphore(0)
        cases = [(conversation(300 + i, 1)[0], p) for i, p in enumerate(MOVING)]
        outcomes, took = replies_while(client, cases, streaming, lambda: c.kill("decode-1"))
        assert took < 60
        assert_as_the_reference(reference, outcomes)
        partner = c.child("decode-0").proc
        assert partner.wait(30) == 1
        assert "data-parallel group" in (tmp_path / "run" / "decode-0.log").read_text()
        deadline = time.monotonic() + 20
        while client.stats()["engines_alive_by_role"]["decode"] != 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert client.stats()["engines_alive_by_role"]["decode"] == 2
        client.close()


def test_bad_groups_are_refused_before_anything_starts(tiny_dirs, tmp_path):
    config = open_checkpoint(tiny_dirs["qwen3_moe"]).config
    with pytest.raises(ConfigError, match="does not divide the model's 8 routed experts"):
        check_parallel(
            config, EngineConfig(parallel=ParallelConfig(data_parallel_size=3, data_parallel_master="127.0.0.1:1"))
        )
    with pytest.raises(ConfigError, match="has none"):
        check_parallel(
            open_checkpoint(tiny_dirs["llama"]).config,
            EngineConfig(parallel=ParallelConfig(data_parallel_size=2, data_parallel_master="h:1")),
        )
    with pytest.raises(ConfigError, match="host:port"):
        ParallelConfig(data_parallel_size=2)
    with pytest.raises(ConfigError, match="one rank per engine"):
        ParallelConfig(2, data_parallel_size=2, data_parallel_master="h:1")
    with pytest.raises(ConfigError, match="do not fill groups of 2"):
        check_parallelism(spec(tiny_dirs["qwen3_moe"], tmp_path, num_prefill=1, data_parallel_size=2), config)


def test_a_nodes_engines_form_one_group(tmp_path):
    """``dualpath node --data-parallel``: engine i of the node is rank i of a group of all of them, meeting on this
    host (Helm's ``<role>.dataParallel``)."""
    from dualpath.launcher import NodeEngines, NodeSpec

    node = NodeEngines(NodeSpec("decode", "127.0.0.1:1", engines=4, data_parallel=True), str(tmp_path))
    args = [node.engine_args(i) for i in range(4)]
    opts = [
        dict(zip(a[a.index("--data-parallel-size") :: 2], a[a.index("--data-parallel-size") + 1 :: 2])) for a in args
    ]
    assert [o["--data-parallel-rank"] for o in opts] == ["0", "1", "2", "3"]
    assert {o["--data-parallel-size"] for o in opts} == {"4"} and len({o["--data-parallel-master"] for o in opts}) == 1
    plain = NodeEngines(NodeSpec("decode", "127.0.0.1:1", engines=4), str(tmp_path / "p")).engine_args(0)
    assert "--data-parallel-size" not in plain
