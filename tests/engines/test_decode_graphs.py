"""Decode steps on CUDA graphs' static buffers (``engines/graphs.py``). On CPU the captured step runs eagerly on
the same buffers (``capture=False``): padding, device-side lengths, wide block tables and the mirrored KV writes
of padding rows are all checked against the plain eager step; only the capture itself needs a GPU (the last test).

Tolerance: logits within 1e-4 of the eager step's (max abs, float32), greedy tokens identical.
"""

import pytest
import torch

from dualpath.core.geometry import KVGeometry
from dualpath.core.sampling_params import SamplingParams
from dualpath.engines.graphs import DecodeGraphs, graph_batch_sizes, use_decode_graphs
from dualpath.engines.kv_cache import PagedKVCache
from dualpath.engines.local import LocalEngine, ModelRunner
from dualpath.engines.models import load_model
from dualpath.engines.sequence import Sequence
from host_transfers import host_transfers

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BS = 16
CACHE = 64 << 20  # KV cache bytes of each LLM (the default takes 0.9 of the GPU: one LLM at a time)


def test_graph_batch_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(5) == [1, 2, 4, 5]
    assert graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


def test_graphs_only_where_they_can_be_captured(tiny_dirs):
    llama = load_model(tiny_dirs["llama"], "cpu", kernels="triton")
    assert not use_decode_graphs(llama, torch.device("cpu"), False)  # CPU: nothing to capture
    assert use_decode_graphs(llama, torch.device("cuda"), False)
    assert not use_decode_graphs(llama, torch.device("cuda"), True)  # enforce_eager
    assert not use_decode_graphs(load_model(tiny_dirs["llama"], "cpu", kernels="torch"), torch.device("cuda"), False)
    assert load_model(tiny_dirs["deepseek_v3"], "cpu", kernels="triton").graph_safe  # fused MoE kernels
    assert load_model(tiny_dirs["qwen3_moe"], "cpu", kernels="triton").graph_safe  # softmax routing: no host work
    assert not load_model(tiny_dirs["deepseek_v3"], "cpu", kernels="torch").graph_safe  # asks which experts run
    assert load_model(tiny_dirs["deepseek_v32"], "cpu", kernels="triton").graph_safe  # the indexer's choice too


@pytest.mark.parametrize(
    "arch,kernels,reads_host",
    [
        ("llama", "triton", False),
        ("llama", "torch", True),
        pytest.param("deepseek_v32", "triton", False, marks=pytest.mark.slow),  # (graph_safe checked above)
    ],
)
def test_the_captured_step_reads_nothing_on_the_host(tiny_dirs, monkeypatch, arch, kernels, reads_host):
    """A CPU stand-in for "capturable": no code of ours turns a tensor into a host value, or host values into a
    tensor (a copy to the GPU), inside the step (the torch reference does, which is why graphs need the Triton
    kernels). DeepSeek-V3.2's graphs hold 100 tokens, past its index_topk (16): the indexer chooses on the device."""
    model = load_model(tiny_dirs[arch], DEVICE, kernels=kernels)
    cache = PagedKVCache(KVGeometry.for_model(model.config, "float32", BS), 32, DEVICE)
    graphs = DecodeGraphs(model, cache, 8, 100, capture=False)
    with torch.inference_mode(), host_transfers() as reads:
        graphs._step(4)
    assert bool(reads) == reads_host, reads


@pytest.mark.slow  # ~3.5 s; the base model's captured steps stay in the default run
def test_the_captured_lora_step_reads_nothing_on_the_host(tiny_dirs, tiny_adapters):
    model = load_model(tiny_dirs["llama"], DEVICE, kernels="triton")
    model.add_adapter(tiny_adapters["poet"])
    cache = PagedKVCache(KVGeometry.for_model(model.config, "float32", BS), 32, DEVICE)
    graphs = DecodeGraphs(model, cache, 8, 100, capture=False)
    with torch.inference_mode(), host_transfers() as reads:
        graphs._step(4, lora=True)
    assert not reads, reads


def test_a_failed_capture_leaves_decode_eager(tiny_dirs, monkeypatch, caplog):
    import dualpath.engines.graphs as graphs_mod

    model = load_model(tiny_dirs["llama"], DEVICE, kernels="triton")
    cache = PagedKVCache(KVGeometry.for_model(model.config, "float32", BS), 32, DEVICE)
    monkeypatch.setattr(graphs_mod, "use_decode_graphs", lambda *a: True)

    def fail(self):
        raise RuntimeError("operation not permitted when stream is capturing")  # what an uncapturable op raises

    monkeypatch.setattr(graphs_mod.DecodeGraphs, "_capture_all", fail)
    with caplog.at_level("WARNING", logger="dualpath.engines.graphs"):
        engine = LocalEngine(model, cache, max_num_seqs=4, max_model_len=64)
    assert engine.runner.graphs is None
    assert "decode steps run eagerly: capturing CUDA graphs failed" in caplog.text
    seq = Sequence("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add(seq)
    while engine.has_work():
        engine.step()
    assert len(seq.output_ids) == 3


def _prefilled(model, prompts: list[list[int]], graphs_max_len: int = 0, capture: bool = False, adapters=None):
    """A paged cache holding each prompt's KV (blocks shuffled by freeing a spacer), sequences ready to decode
    their last prompt token next (under ``adapters[i]``, identities, if given), and decode graphs of up to 8
    sequences made before anything was cached (as an engine makes them), or None."""
    geom = KVGeometry.for_model(model.config, "float32", BS)
    cache = PagedKVCache(geom, 64, DEVICE)
    graphs = DecodeGraphs(model, cache, 8, graphs_max_len, capture) if graphs_max_len else None
    cache.reserve("spacer", 40)
    runner = ModelRunner(model, cache)
    seqs = []
    for i, p in enumerate(prompts):
        s = Sequence(
            f"s{i}",
            p,
            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapter=adapters[i] if adapters else ""),
        )
        cache.reserve(s.seq_id, len(p) + 1)
        if len(p) > 1:
            runner.forward([s], [len(p) - 1])
        seqs.append(s)
    cache.free("spacer")
    return cache, seqs, graphs


def _decoded_twice(model, cache, seqs, graphs):
    """One decode step eagerly, then the same step again through ``graphs`` from the same cache: (eager logits,
    graph logits, eager KV written, graph KV written)."""
    before = cache.storage.clone()
    eager = ModelRunner(model, cache).forward(seqs, [1] * len(seqs))
    eager_kv = cache.storage.clone()
    cache.storage.copy_(before)
    for s in seqs:
        s.num_computed -= 1
    got = ModelRunner(model, cache, graphs).forward(seqs, [1] * len(seqs)).clone()  # a view of the graphs' buffer
    return eager, got, eager_kv, cache.storage


# exact bucket, and 1 and 3 padding rows; triton at 3 and 5: 10-13 s in the interpreter. DeepSeek-V3.2 past its
# index_topk (16): the eager step knows the longest context and the graph's does not, both choose on the device
@pytest.mark.parametrize(
    "kernels, n, arch",
    [("torch", 1, "llama"), ("torch", 3, "llama"), ("torch", 5, "llama"), ("triton", 1, "llama")]
    + [
        pytest.param("triton", n, arch, marks=pytest.mark.slow)
        for n, arch in ((3, "llama"), (5, "llama"), (3, "deepseek_v32"))
    ],
)
def test_graph_step_matches_the_eager_step(tiny_dirs, kernels, n, arch):
    model = load_model(tiny_dirs[arch], DEVICE, kernels=kernels)
    prompts = [list(range(3, 3 + k)) for k in (1, 16, 17, 33, 40)[:n]]  # empty cache, block boundaries
    capture = DEVICE == "cuda" and kernels == "triton"  # the torch reference reads lengths on the host
    cache, seqs, graphs = _prefilled(model, prompts, graphs_max_len=200, capture=capture)
    before = cache.storage.clone()
    eager, got, eager_kv, graph_kv = _decoded_twice(model, cache, seqs, graphs)
    assert [s.num_computed for s in seqs] == [len(p) for p in prompts]
    assert (got - eager).abs().max() < 1e-4
    assert torch.equal(graph_kv != before, eager_kv != before)  # the same slots, no others (padding rows: nothing)
    assert (graph_kv - eager_kv).abs().max() < 1e-5


def test_lora_rows_replay_graphs_with_the_eager_logits(tiny_dirs, tiny_adapters, monkeypatch):
    """A decode step mixing the base model and two adapters (3 rows in the graph of 4: a padding row repeats the
    first) replays the LoRA graph, whose every row runs each adapter masked to its own rows, and equals the eager
    step, which gathers each adapter's rows; adapters loaded after the capture, or past MAX_GRAPH_ADAPTERS, run
    eagerly."""
    import dualpath.engines.graphs as graphs_mod

    model = load_model(tiny_dirs["llama"], DEVICE, kernels="torch")
    ids = [model.add_adapter(tiny_adapters[name]) for name in ("sql", "poet")]
    prompts = [list(range(3, 3 + k)) for k in (16, 17, 33)]
    cache, seqs, graphs = _prefilled(model, prompts, graphs_max_len=200, adapters=[ids[0], "", ids[1]])
    assert graphs.adapters == tuple(ids)
    steps = []
    monkeypatch.setattr(
        graphs, "_step", lambda size, lora=False, step=graphs._step: (steps.append((size, lora)), step(size, lora))
    )
    before = cache.storage.clone()
    eager, got, eager_kv, graph_kv = _decoded_twice(model, cache, seqs, graphs)
    assert steps == [(4, True)]
    assert (got - eager).abs().max() < 1e-4
    assert torch.equal(graph_kv != before, eager_kv != before) and (graph_kv - eager_kv).abs().max() < 1e-5
    for s in seqs:  # the adapters change their rows: the masks are not all zeros
        s.num_computed -= 1
        s.params = SamplingParams(temperature=0, max_tokens=8)
    base = ModelRunner(model, cache, graphs).forward(seqs, [1] * 3)
    assert steps[-1] == (4, False) and (base[1] - got[1]).abs().max() < 1e-4
    assert min((base[i] - got[i]).abs().max() for i in (0, 2)) > 1e-3
    assert not graphs.fits(3, 3, ["an adapter loaded later"])
    monkeypatch.setattr(graphs_mod, "MAX_GRAPH_ADAPTERS", 1)
    first_only = DecodeGraphs(model, cache, 8, 200, capture=False)
    assert (
        first_only.adapters == (ids[0],) and first_only.fits(3, 3, [ids[0], ""]) and not first_only.fits(3, 3, [ids[1]])
    )


def test_graphs_fall_back_to_eager_beyond_their_sizes(tiny_dirs, monkeypatch):
    model = load_model(tiny_dirs["llama"], DEVICE, kernels="torch")
    cache, seqs, _ = _prefilled(model, [[5, 6], [7, 8, 9], list(range(3, 53))])
    graphs = DecodeGraphs(model, cache, max_batch=2, max_model_len=40, capture=False)
    assert graphs.max_blocks == 3 and graphs.fits(2, 3) and not graphs.fits(3, 1) and not graphs.fits(1, 4)
    calls = []
    monkeypatch.setattr(graphs, "run", lambda *a: calls.append(a))
    runner = ModelRunner(model, cache, graphs)

    def step(batch):
        runner.forward(batch, [1] * len(batch))
        for s in batch:
            s.num_computed -= 1  # the same token again next time

    step(seqs[:2])
    assert len(calls) == 1
    step(seqs)  # three sequences: over the largest graph
    step(seqs[2:])  # a table of 4 blocks: over the graphs' capacity
    assert len(calls) == 1


# the Triton variant takes ~40 s in the interpreter; graph steps on the Triton kernels are checked in the default run
@pytest.mark.parametrize("kernels", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_generation_on_graph_buffers_matches_eager(tiny_dirs, kernels):
    """Continuous batching whose decode batch shrinks through the sizes (5 -> 1 sequences, buckets 8, 4, 2, 1)."""
    model = load_model(tiny_dirs["llama"], DEVICE, kernels=kernels)
    geom = KVGeometry.for_model(model.config, "float32", BS)
    prompts = [list(range(3, 3 + k)) for k in (5, 16, 23, 1, 40)]
    outs = {}
    for graphed in (False, True):
        cache = PagedKVCache(geom, 64, DEVICE)
        engine = LocalEngine(model, cache, max_num_seqs=8, max_model_len=128, enforce_eager=True)
        if graphed:
            capture = DEVICE == "cuda" and kernels == "triton"
            engine.runner.graphs = DecodeGraphs(model, cache, 8, 128, capture=capture)
        seqs = [
            Sequence(f"s{i}", p, SamplingParams(temperature=0, max_tokens=2 + 2 * i, ignore_eos=True, logprobs=1))
            for i, p in enumerate(prompts)
        ]
        for s in seqs:
            engine.add(s)
        while engine.has_work():
            engine.step()
        outs[graphed] = seqs
        cache.check()
        assert cache.num_free_blocks == 64
    for a, b in zip(outs[False], outs[True]):
        assert a.output_ids == b.output_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_llm_replays_captured_graphs_with_the_eager_tokens(tiny_dirs):
    from dualpath.llm import LLM

    prompts = [list(range(3, 40)), [5, 6, 7], list(range(100, 121))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(
            str(tiny_dirs["llama"]),
            device="cuda",
            block_size=BS,
            max_num_seqs=8,
            kernels="triton",
            enforce_eager=eager,
            kv_cache_bytes=CACHE,
        )
        assert (llm.engine.runner.graphs is None) == eager
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs[False] == outs[True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_llm_replays_lora_graphs_with_the_eager_tokens(tiny_dirs, tiny_adapters):
    """Requests under two adapters and the base model in one batch: the same tokens on graphs as eagerly."""
    from dualpath.llm import LLM

    prompts = [list(range(3, 40)), [5, 6, 7], list(range(100, 121))]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = {}
    for eager in (True, False):
        llm = LLM(
            str(tiny_dirs["llama"]),
            device="cuda",
            block_size=BS,
            max_num_seqs=8,
            kernels="triton",
            enforce_eager=eager,
            kv_cache_bytes=CACHE,
            lora_modules={k: str(v) for k, v in tiny_adapters.items()},
        )
        assert (llm.engine.runner.graphs is None) == eager
        assert eager or len(llm.engine.runner.graphs.adapters) == 2
        outs[eager] = [o.token_ids for o in llm.generate(prompts, params, lora_request=["sql", None, "poet"])]
    assert outs[False] == outs[True]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_captured_graphs_decode_with_weights_reloaded_in_place(tiny_dirs, tmp_path):
    """Graphs captured before a weight update replay over the new values (``update_weights`` copies into the
    tensors the graphs point at)."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint
    from dualpath.llm import LLM

    other = build_tiny_checkpoint(tmp_path / "other", "llama", seed=2)
    prompts = [list(range(3, 40)), [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(
        str(tiny_dirs["llama"]), device="cuda", block_size=BS, max_num_seqs=8, kernels="triton", kv_cache_bytes=CACHE
    )
    assert llm.engine.runner.graphs is not None
    before = [o.token_ids for o in llm.generate(prompts, params)]
    llm.update_weights(str(other))
    after = [o.token_ids for o in llm.generate(prompts, params)]
    fresh = LLM(
        str(other),
        device="cuda",
        block_size=BS,
        max_num_seqs=8,
        kernels="triton",
        enforce_eager=True,
        kv_cache_bytes=CACHE,
    )
    assert after == [o.token_ids for o in fresh.generate(prompts, params)] and after != before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_speculative_steps_beside_captured_graphs_change_no_output(tiny_dirs):
    """Steps with drafts run eagerly through the varlen prefill kernel, steps without replay graphs; the tokens
    are plain decoding's."""
    from dualpath.llm import LLM

    prompts = [list(range(3, 40)), [5, 6, 7, 8] * 10]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(device="cuda", block_size=BS, max_num_seqs=8, kernels="triton", kv_cache_bytes=CACHE)
    plain = LLM(str(tiny_dirs["llama"]), **kw)
    spec = LLM(str(tiny_dirs["llama"]), speculative_config={"num_speculative_tokens": 4, "prompt_lookup_min": 1}, **kw)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want
    assert spec.engine.spec_stats["accepted"] > 0


def test_enforce_eager_reaches_every_engine():
    """``--enforce-eager`` on ``engine``, ``serve`` and ``rollout`` ends in the engine's config and in the command
    line the launcher gives each engine process."""
    from dualpath.cli import build_parser, engine_config
    from dualpath.launcher import ClusterSpec, LocalCluster

    p = build_parser()
    args = p.parse_args(["engine", "--role", "decode", "--model", "m", "--scheduler", "h:1", "--enforce-eager"])
    assert engine_config(args).engine.enforce_eager
    assert not engine_config(
        p.parse_args(["engine", "--role", "decode", "--model", "m", "--scheduler", "h:1"])
    ).engine.enforce_eager
    for cmd in ("serve", "rollout"):
        assert "--enforce-eager" in p._subparsers._group_actions[0].choices[cmd].format_help()
    for eager in (True, False):
        cluster = LocalCluster.__new__(LocalCluster)
        cluster.spec, cluster.scheduler_address = ClusterSpec(model="m", enforce_eager=eager), "h:1"
        assert ("--enforce-eager" in cluster._engine_args("decode", 0, 0)) == eager
