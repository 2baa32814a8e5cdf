"""Issue 52's GPU run prepared on CPU (``bench/gpu/run_e2e.sh``), so that the first GPU run measures instead of
debugging: the decode roofline's byte counts against a hand count, its smoke run's JSON, the serving bench's pure
parts (its load generator's bookkeeping, the options it starts ``dualpath serve`` and ``dualpath bench agentic``
with, against the real parsers), and, slow, the whole script's smoke run on tiny models."""

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dualpath.cli import build_parser
from dualpath.core.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"


def _load(name: str):
    """A ``bench/gpu`` module by file, not through sys.path: ``bench/gpu/kernels.py`` would shadow the kernels
    package for every later test."""
    spec = importlib.util.spec_from_file_location(f"bench_gpu_{name}", GPU / f"{name}.py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


roofline, load = _load("roofline"), _load("serve_load")

LLAMA3_8B = {  # Meta-Llama-3-8B's config.json, as the bench builds it (no hub)
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
}


def test_llama3_8b_step_reads_its_published_parameters_less_the_embedding():
    """8,030,261,248 parameters (Meta's count), of which the embedding is 128,256 x 4,096: a step reads the rest
    once, in bfloat16. Its KV: 32 layers x 8 heads x 128 x (K, V) x 2 bytes = 128 KiB a token."""
    c = ModelConfig.from_hf(LLAMA3_8B)
    assert roofline.weight_bytes(c) == 2 * (8_030_261_248 - 128_256 * 4096) == 15_009_849_344
    assert roofline.kv_bytes(c, 64, 2048) == 64 * 2048 * 128 * 1024
    assert roofline.kv_bytes(c, 2, 10.5) == 2 * 10.5 * 128 * 1024
    # 15.0 GB + 17.2 GB (16 GiB) at 4.3 TB/s (an H200's copy): 7.5 ms a step at best
    assert roofline.bound_seconds(15_009_849_344, 64 * 2048 * 131072, 4.3e12) == pytest.approx(7.49e-3, rel=0.01)
    with pytest.raises(ValueError, match="dense"):
        roofline.weight_bytes(dataclasses.replace(c, moe=object()))  # (an MoE step reads only its experts)


@pytest.mark.slow  # ~8 s: eight shapes' smoke steps on CPU (the default run keeps under 10 minutes)
def test_decode_roofline_smoke_reports_each_shape_against_its_bound(tmp_path):
    """The bench at tiny shapes on CPU: every shape measured, its bound (weights + the timed steps' mean KV over the
    copy bandwidth) as counted by hand from the built checkpoint's config, and the count of the weights equal to
    the loaded model's parameters (less the embedding)."""
    out = tmp_path / "roof.json"
    cmd = [sys.executable, str(GPU / "decode_roofline.py"), "--smoke", "--models", "llama3_8b"]
    res = subprocess.run(
        [*cmd, "--work", str(tmp_path), "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert res.returncode == 0, res.stderr[-3000:]
    d = json.loads(out.read_text())
    m, sizes, bw = d["llama3_8b"], d["sizes"], d["copy"]["copy_bytes_per_s"]
    hf = json.loads((Path(m["path"]) / "config.json").read_text())
    h, layers, kv_heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_key_value_heads"]
    head = h // hf["num_attention_heads"]
    inter, vocab = hf["intermediate_size"], hf["vocab_size"]
    by_hand = 2 * (layers * (2 * h * h + 2 * h * kv_heads * head + 3 * h * inter + 2 * h) + h + vocab * h)
    assert m["weight_bytes"] == m["loaded_weight_bytes"] == by_hand
    rows = m["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(b, n) for n in sizes["contexts"] for b in sizes["batches"]]
    mean_extra = sizes["warmup"] + (sizes["steps"] + 1) / 2
    for r in rows:
        kv = int(r["batch"] * (r["context"] + mean_extra) * layers * 2 * kv_heads * head * 2)
        assert r["kv_bytes"] == kv
        assert r["bound_seconds"] == pytest.approx((by_hand + kv) / bw)
        assert r["vs_bound"] == pytest.approx(r["step_seconds"] / r["bound_seconds"])
        assert r["step_seconds"] > 0 and r["tokens_per_s"] == pytest.approx(r["batch"] / r["step_seconds"])
        assert r["profile"] == {} and r["decode_graphs"] is False  # CPU: no graphs, no device profile
    assert "llama3_8b" in res.stdout and "vs_bound" in res.stdout  # the table


def test_the_load_generator_counts_tokens_and_times_from_the_stream():
    reply = load.Reply(sent=10.0)
    for line, at in (
        ("", 10.1),
        ('data: {"choices": [{"index": 0, "text": "", "token_ids": []}]}', 10.2),  # no token yet
        ('data: {"choices": [{"index": 0, "text": "a", "token_ids": [5]}]}', 10.5),
        ('data: {"choices": [{"index": 0, "text": "bc", "token_ids": [6, 7]}]}', 10.9),
        ('data: {"choices": [{"index": 0, "text": "", "token_ids": [8], "finish_reason": "length"}]}', 11.1),
        ("data: [DONE]", 11.2),
    ):
        reply.feed(line, at)
    assert reply.tokens == 4
    assert reply.first == pytest.approx(0.5) and reply.last == pytest.approx(1.1)
    assert reply.tpot == pytest.approx(0.6 / 3)
    failed = load.Reply(sent=0.0, error="HTTP 503")
    s = load.load_summary([reply, failed], wall=2.0, rate=4.0)
    assert s["requests"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["output_tokens"] == 4 and s["output_tokens_per_s"] == 2.0
    assert s["ttft_p50_s"] == pytest.approx(0.5) and s["tpot_p99_s"] == pytest.approx(0.2)
    assert load.percentile([], 50) is None
    assert [load.percentile(list(range(1, 101)), q) for q in (50, 99, 100)] == [50, 99, 100]


def test_workloads_are_drawn_the_same_for_a_seed_within_their_ranges():
    w = load.Workload(requests=20, prompt_lens=(3, 9), output_lens=(2, 4), vocab=50)
    drawn = w.draw()
    assert drawn == w.draw() and drawn != load.Workload(20, (3, 9), (2, 4), seed=1, vocab=50).draw()
    assert all(3 <= len(p) <= 9 and 2 <= n <= 4 and all(3 <= t < 50 for t in p) for p, n in drawn)


def test_the_benches_start_the_product_with_options_it_has():
    """The server's and the agentic bench's command lines parse with dualpath's own parser (a renamed option
    fails here, not on the GPU), every engine on the one device with the decode engine's share."""
    parser = build_parser()
    serve = parser.parse_args(["serve", *load.ServeSetup().serve_args("/m", "/kv")])
    assert (serve.model, serve.device, serve.dtype, serve.gpu_memory_utilization) == ("/m", "cuda:0", "bfloat16", 0.5)
    assert (serve.prefill, serve.decode, serve.kv_store) == (1, 1, "/kv")
    cpu = parser.parse_args(["serve", *load.ServeSetup(device="cpu", dtype="float32").serve_args("/m", "/kv")])
    assert cpu.device == "cpu" and cpu.gpu_memory_utilization == 0.9  # (the default: no share on a CPU)
    bench = parser.parse_args(load.AgenticRun().args("/m", "/out"))
    assert (bench.device, bench.dtype, bench.cache_bytes, bench.decode) == ("cuda:0", "bfloat16", 8_000_000_000, 2)
    assert bench.systems == "basic,dualpath,oracle" and bench.out == "/out"
    assert parser.parse_args(load.AGENTIC_SMOKE.args("/m", "/o")).cache_bytes == 64_000_000


def test_agentic_ratios_hold_dualpath_against_basic_and_oracle():
    systems = [
        {"system": "basic", "job_completion_time_s": 10.0, "jct_vs_basic": 1.0, "jct_vs_oracle": 2.5, "hit_rate": 0.9},
        {"system": "dualpath", "job_completion_time_s": 5.0, "jct_vs_basic": 0.5, "jct_vs_oracle": 1.25},
        {"system": "oracle", "job_completion_time_s": 4.0, "jct_vs_basic": 0.4, "jct_vs_oracle": 1.0},
    ]
    r = load.agentic_ratios({"cap_bps": 1e6, "systems": systems})
    assert (r["jct_vs_basic"], r["jct_vs_oracle"]) == (0.5, 1.25)
    assert r["met"] == {"jct_vs_basic": True, "jct_vs_oracle": False}
    assert r["systems"]["basic"]["hit_rate"] == 0.9 and r["systems"]["oracle"]["ttft_p50_s"] is None


@pytest.mark.slow  # ~3-5 minutes on two busy cores: four clusters of CPU engines start
@pytest.mark.timeout(1200)
def test_the_e2e_script_runs_on_cpu_with_tiny_models(tmp_path):
    """``run_e2e.sh --smoke``: the roofline, the server against the offline LLM, and the agentic bench's three
    systems each write their JSON (the 1.1B-shaped tiny model; the LoRA and FP8 parts are skipped there)."""
    env = {**os.environ, "OUT": str(tmp_path), "SERVE_MODELS": "llama_1b", "ROOFLINE_LIMIT_S": "200"}
    env.update(SERVING_LIMIT_S="300", AGENTIC_LIMIT_S="400")
    res = subprocess.run(["bash", str(GPU / "run_e2e.sh"), "--smoke"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]
    log = (tmp_path / "e2e.log").read_text()
    assert "== lora: skipped" in log and "run_e2e.sh:" in log
    roof = json.loads((tmp_path / "decode_roofline.json").read_text())
    assert all("error" not in roof[m] and roof[m]["rows"] for m in ("llama_1b", "llama3_8b"))
    serving = json.loads((tmp_path / "gpu_serving.json").read_text())["llama_1b"]
    assert serving["saturated"]["failed"] == serving["half_load"]["failed"] == 0, serving.get("log_tail")
    assert serving["saturated"]["output_tokens"] == serving["offline"]["output_tokens"]  # the same workload
    assert serving["serving_vs_offline"] > 0 and serving["half_load"]["ttft_p50_s"] > 0
    agentic = json.loads((tmp_path / "gpu_agentic.json").read_text())["llama_1b"]
    assert set(agentic["systems"]) == {"basic", "dualpath", "oracle"} and agentic["cap_bps"] > 0
    assert agentic["jct_vs_basic"] > 0 and agentic["jct_vs_oracle"] > 0


def test_the_performance_page_renders_the_gpu_run_once_its_results_are_there(tmp_path, monkeypatch):
    """Until a GPU run's files are committed each part says "Not yet measured on a GPU"; a smoke run's files do not
    count; a GPU run's become the tables, with each target met or not."""
    spec = importlib.util.spec_from_file_location("gen_performance_e2e", ROOT / "docs" / "gen_performance.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    monkeypatch.setattr(gen, "RESULTS", tmp_path)
    e2e = tmp_path / "gpu" / "e2e"
    e2e.mkdir(parents=True)
    assert gen.gpu_e2e().count("Not yet measured on a GPU.") == 4
    row = {"batch": 64, "context": 2048, "step_seconds": 0.009, "bound_seconds": 0.0075, "vs_bound": 1.2}
    skipped = {"batch": 64, "context": 16384, "skipped": "KV 128.6 GiB > 99.0 GiB free"}
    roof = {"copy": {"copy_bytes_per_s": 4.3e12}, "targets": {"llama_1b": 2.0, "llama3_8b": 1.3}}
    roof["llama3_8b"] = {"rows": [{**row, "launches_per_step": 420}, skipped]}
    load_run = {"output_tokens_per_s": 9000.0, "ttft_p50_s": 0.05, "ttft_p99_s": 0.2, "tpot_p50_s": 0.008}
    serving = {"llama_1b": {"offline": {"output_tokens_per_s": 10000.0}, "saturated": load_run}}
    serving["llama_1b"].update(half_load=load_run, serving_vs_offline=0.9, target=0.9)
    times = {"ttft_p50_s": 0.1, "ttft_p99_s": 0.5, "tpot_p50_s": 0.01, "hit_rate": 0.9}
    systems = {s: {"job_completion_time_s": t, **times} for s, t in (("basic", 20.0), ("dualpath", 10.0))}
    agentic = {"llama_1b": {"systems": systems, "cap_bps": 2e8, "jct_vs_basic": 0.5, "jct_vs_oracle": 1.2}}
    agentic["llama_1b"].update(targets=load.AGENTIC_TARGETS, met={"jct_vs_basic": True, "jct_vs_oracle": False})
    lora = {"lora": {"systems": {"one_adapter": {"decode_vs_base": 0.75, "decode_graphs": True}}}}
    lora["lora"]["target_decode_vs_base"] = 0.7
    files = {"decode_roofline": roof, "gpu_serving": serving, "gpu_agentic": agentic, "lora": lora}
    for name, d in files.items():
        (e2e / f"{name}.json").write_text(json.dumps({**d, "smoke": True}))
    assert gen.gpu_e2e().count("Not yet measured on a GPU.") == 4  # a smoke run is no measurement
    for name, d in files.items():
        (e2e / f"{name}.json").write_text(json.dumps(d))
    text = gen.gpu_e2e()
    assert "Not yet" not in text and "(4.30 TB/s)" in text
    assert "| llama3_8b | 64 | 2,048 | 9.00 | 7.50 | **1.20×** | 420 | ≤ 1.3×: met |" in text
    assert "| llama3_8b | 64 | 16,384 | skipped |" in text
    assert "| llama_1b | 10,000 | 9,000 | ≥ 0.9: **0.90×** met | 50 / 200 | 8.0 |" in text
    assert "DualPath 0.50× Basic's JCT (≤ 0.55×: met) and 1.20× Oracle's (≤ 1.1×: **not met**)" in text
    assert "One adapter: **0.75×** the base model's decode (met); on graphs: yes." in text
    assert "Source: `bench/results/gpu/e2e/decode_roofline.json`" in text
