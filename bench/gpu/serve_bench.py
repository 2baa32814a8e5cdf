"""The product on one GPU (issue 52, item 3): ``dualpath serve`` with a prefill and a decode engine sharing the one
device (``--device cuda:0``, the decode engine's part ``--gpu-memory-utilization``), against the offline ``LLM`` on
the same GPU in the same run, and ``dualpath bench agentic`` there with storage the bottleneck.

  serving  for each model: the offline ``LLM``'s output tokens/s over a workload of random prompt and output
           lengths (a process of its own, so its memory is back before the server starts), then the server's under
           a fixed-rate open-loop load of the same workload at twice that request rate (saturated: the ratio, target
           >= 0.9) and of another at half of it (TTFT and TPOT under load), streamed completions of token ids
  agentic  ``dualpath bench agentic`` (1P2D on the one GPU, every node's storage reads capped at a fraction of the
           Oracle's rate so that Basic is storage-bound): DualPath, Basic and Oracle JCT, TTFT p50/p99, TPOT, hit
           rates, and DualPath's JCT over Basic's (target <= 0.55) and over Oracle's (<= 1.10)

The models are ``decode_roofline.py``'s (the 1.1B Llama and Llama-3-8B's shape, random weights, built in
``--work``).

    python bench/gpu/serve_bench.py serving --out OUT.json [--models llama_1b llama3_8b] [--work DIR] [--smoke]
    python bench/gpu/serve_bench.py agentic --out DIR [--models llama_1b] [--work DIR] [--smoke]

``--smoke`` runs both on CPU with tiny models (``bench/gpu/serve.sh --smoke``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1] / "tests" / "support")]  # (not there under PYTHONSAFEPATH)
from decode_roofline import MODELS, ROOT, model_path  # noqa: E402
from serve_load import (  # noqa: E402
    AGENTIC_SMOKE,
    FULL,
    SERVING_TARGET,
    TINY,
    AgenticRun,
    ServeSetup,
    Workload,
    agentic_ratios,
    open_loop,
)


def offline(model: str, setup: ServeSetup, workload: Workload) -> dict:
    """The offline ``LLM`` on the workload, once warm: output tokens/s (run by ``--offline``, in a process of its
    own). Its KV cache is the decode engine's share of the device."""
    from dualpath import LLM, SamplingParams

    work = workload.draw()
    llm = LLM(
        model,
        device=setup.device,
        dtype=setup.dtype,
        max_num_seqs=setup.max_num_seqs,
        gpu_memory_utilization=setup.decode_share,
    )
    prompts = [p for p, _ in work]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work]
    llm.generate(prompts[: setup.max_num_seqs], params[: setup.max_num_seqs])  # warm: kernels compiled, graphs used
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall, "requests": len(work)}


def offline_in_child(model: str, setup: ServeSetup, workload: Workload, out: Path) -> dict:
    cmd = [sys.executable, __file__, "offline", "--model", model, "--out", str(out)]
    cmd += ["--setup", json.dumps(asdict(setup)), "--workload", json.dumps(asdict(workload))]
    subprocess.run(cmd, check=True, cwd=ROOT)
    return json.loads(out.read_text())


def serve_model(model: str, setup: ServeSetup, workload: Workload, tmp: Path) -> dict:
    """Offline first, then the server: saturated (twice the offline request rate, the same requests) and at half
    of it (half as many other requests, so it lasts about as long as the offline run; none hits the stored KV of
    another run)."""
    import httpx
    from serve_process import ServeProcess

    base = offline_in_child(model, setup, workload, tmp / "offline.json")
    rate = base["requests"] / base["seconds"]
    t = time.perf_counter()
    server = ServeProcess(*setup.serve_args(model, tempfile.mkdtemp(prefix="kv-", dir=tmp)), timeout=600)
    started = time.perf_counter() - t
    try:
        name = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        warm = replace(workload, requests=min(workload.requests, setup.max_num_seqs), seed=workload.seed + 2)
        asyncio.run(open_loop(server.url, name, warm.draw(), 4 * rate))  # kernels and graphs warm in both engines
        saturated = asyncio.run(open_loop(server.url, name, workload.draw(), 2 * rate))
        half = replace(workload, requests=max(1, workload.requests // 2), seed=workload.seed + 1)  # (as long again)
        loaded = asyncio.run(open_loop(server.url, name, half.draw(), rate / 2))
    finally:
        server.stop()
    return {
        "offline": base,
        "server_start_seconds": started,
        "saturated": saturated,
        "half_load": loaded,
        "serving_vs_offline": saturated["output_tokens_per_s"] / base["output_tokens_per_s"],
        "target": SERVING_TARGET,
        "log_tail": server.log_tail(2000) if saturated["failed"] or loaded["failed"] else "",
    }


def run_serving(args) -> dict:
    smoke = args.smoke
    setup = ServeSetup(device="cpu", dtype="float32") if smoke else ServeSetup()
    work = Path(args.work or tempfile.mkdtemp(prefix="dualpath-serve-"))
    result = {
        "benchmark": "gpu_serving",
        "smoke": smoke,
        "setup": asdict(setup),
        "workload": asdict(TINY if smoke else FULL),
    }
    for name in args.models:
        t = time.perf_counter()
        try:
            path = model_path(name, work, smoke, "cuda" if setup.device.startswith("cuda") else "cpu")
            vocab = 250 if smoke else 32000  # every model's vocabulary holds these ids
            tmp = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
            result[name] = serve_model(str(path), setup, replace(TINY if smoke else FULL, vocab=vocab), tmp)
        except Exception as e:  # noqa: BLE001 - one model failing must not lose the other's numbers
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        result[name]["wall_seconds"] = time.perf_counter() - t
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
        print(f"{name}: {json.dumps(summary_line(name, result[name]))}", flush=True)
    return result


def summary_line(name: str, r: dict) -> dict:
    if "error" in r:
        return {"model": name, "error": r["error"]}
    s, h = r["saturated"], r["half_load"]
    return {
        "model": name,
        "offline_tok_s": round(r["offline"]["output_tokens_per_s"]),
        "served_tok_s": round(s["output_tokens_per_s"]),
        "ratio": round(r["serving_vs_offline"], 3),
        "target": f">= {SERVING_TARGET}",
        "ttft_p50_s": h["ttft_p50_s"],
        "tpot_p50_s": h["tpot_p50_s"],
        "failed": s["failed"] + h["failed"],
    }


def run_agentic(args) -> dict:
    smoke = args.smoke
    run = AGENTIC_SMOKE if smoke else AgenticRun()
    work = Path(args.work or tempfile.mkdtemp(prefix="dualpath-agentic-"))
    out = Path(args.out)
    result = {"benchmark": "gpu_agentic", "smoke": smoke, "run": asdict(run)}
    for name in args.models:
        path = model_path(name, work, smoke, "cuda" if run.device.startswith("cuda") else "cpu")
        cmd = [sys.executable, "-m", "dualpath.cli", "--log-level", "WARNING", *run.args(str(path), str(out / name))]
        t = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT)
        try:
            full = json.loads((out / name / "agentic.json").read_text())
            result[name] = {**agentic_ratios(full), "agentic": full}
        except (OSError, ValueError, KeyError) as e:
            result[name] = {"error": f"exit {done.returncode}: {type(e).__name__}: {e}"}
        result[name]["wall_seconds"] = time.perf_counter() - t
        Path(args.json or out / "summary.json").write_text(json.dumps(result, indent=1))
        print(f"{name}: {json.dumps({k: result[name].get(k) for k in ('jct_vs_basic', 'jct_vs_oracle', 'met')})}")
    return result


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=("serving", "agentic", "offline"))
    ap.add_argument("--out", required=True, help="serving, offline: the JSON; agentic: a directory of its results")
    ap.add_argument("--json", help="agentic: the summary's JSON (default: summary.json in --out)")
    ap.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    ap.add_argument("--work", default=None, help="where the random checkpoints are (built if missing)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--model", help=argparse.SUPPRESS)  # offline: the checkpoint
    ap.add_argument("--setup", help=argparse.SUPPRESS)  # offline: ServeSetup as JSON
    ap.add_argument("--workload", help=argparse.SUPPRESS)  # offline: Workload as JSON
    args = ap.parse_args(argv)
    if args.part == "offline":
        workload = json.loads(args.workload)
        workload = Workload(**{**workload, **{k: tuple(workload[k]) for k in ("prompt_lens", "output_lens")}})
        result = offline(args.model, ServeSetup(**json.loads(args.setup)), workload)
        Path(args.out).write_text(json.dumps(result))
        return result
    return run_serving(args) if args.part == "serving" else run_agentic(args)


if __name__ == "__main__":
    main()
