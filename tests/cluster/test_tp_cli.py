"""Tensor parallelism from the command line to each engine's ``EngineConfig.parallel``, without starting engines:
``-tp`` and its YAML key on ``serve``, per-role sizes, the devices and ports the launcher gives each engine, a
size the model cannot take refused before anything starts, ``dualpath engine``/``node``/``generate``, and the
Helm chart's and Slurm scripts' settings (docs/parallelism.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dualpath.cli import _node_tp, _with_config, build_parser, engine_config, main
from dualpath.core.config import ParallelConfig
from dualpath.core.errors import ConfigError
from dualpath.launcher import (
    ClusterSpec,
    LocalCluster,
    NodeEngines,
    NodeSpec,
    check_parallelism,
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """The tiny Llama: 4 attention heads, 2 KV heads, MLP 128, vocabulary 320."""
    from dualpath.checkpoints.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "m", "llama")


def spawned_config(cluster: LocalCluster, role: str, index: int):
    """The ``EngineProcessConfig`` engine ``index`` of ``role`` would run with, from the command the launcher builds."""
    argv = cluster._engine_args(role, index, cluster.spec.first_device(role, index))
    return argv, engine_config(build_parser().parse_args(argv))


def opt(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_serve_refuses_a_size_that_does_not_divide_the_heads_before_starting_anything(llama, tmp_path):
    run = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "dualpath.cli", "serve", "--model", str(llama), "-tp", "3", "--run-dir", str(run)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
    )
    assert r.returncode != 0
    assert "--tensor-parallel-size 3 does not divide the model's attention heads (4)" in r.stderr, r.stderr
    assert "starting" not in r.stdout and not run.exists()  # no process, not even a run directory


def test_a_refused_size_starts_no_cluster(llama, tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(LocalCluster, "__init__", lambda *a, **k: started.append(a))
    for argv in (
        ["-tp", "3"],
        ["--decode-tensor-parallel-size", "8"],
        ["-tp", "2", "--device", "cuda", "--decode", "200"],
    ):
        assert main(["serve", "--model", str(llama), "--run-dir", str(tmp_path / "run"), *argv]) == 2
        err = capsys.readouterr().err
        assert "dualpath: error: --tensor-parallel-size" in err, err
    assert not started
    # rollout and run-batch start their clusters the same way
    (tmp_path / "in.jsonl").write_text(
        '{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}}\n'
    )
    assert (
        main(
            [
                "run-batch",
                str(tmp_path / "in.jsonl"),
                "-o",
                str(tmp_path / "out.jsonl"),
                "--model",
                str(llama),
                "-tp",
                "3",
            ]
        )
        == 2
    )
    assert "does not divide the model's attention heads (4)" in capsys.readouterr().err and not started


def test_check_parallelism_per_role_and_devices(llama):
    from dualpath.engines.models import open_checkpoint

    model = open_checkpoint(str(llama)).config
    check_parallelism(ClusterSpec(model=str(llama), tensor_parallel_size=2), model)
    check_parallelism(ClusterSpec(model=str(llama), prefill_tensor_parallel_size=4), model)
    with pytest.raises(ConfigError, match="does not divide the model's attention heads"):
        check_parallelism(ClusterSpec(model=str(llama), decode_tensor_parallel_size=3), model)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be in"):
        check_parallelism(ClusterSpec(model=str(llama), tensor_parallel_size=0), model)
    with pytest.raises(ConfigError, match=r"needs? .*but this host has \d+ GPU"):
        check_parallelism(ClusterSpec(model=str(llama), num_decode=200, tensor_parallel_size=2, device="cuda"), model)


def test_yaml_and_flags_land_in_each_engines_config(llama, tmp_path):
    from dualpath.serving.serve import cluster_spec

    config = tmp_path / "serve.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": str(llama),
                "tensor_parallel_size": 2,
                "decode": 2,
                "decode_tensor_parallel_size": 1,
                "tp_join_timeout": 30,
            }
        )
    )
    args = _with_config(build_parser(), ["serve", "--config", str(config)])
    spec, _, _ = cluster_spec(args)
    assert (spec.tp("prefill"), spec.tp("decode"), spec.tp_join_timeout_s) == (2, 1, 30.0)
    cluster = LocalCluster(spec, run_dir=str(tmp_path / "run"))
    argv, cfg = spawned_config(cluster, "prefill", 0)
    assert cfg.engine.parallel == ParallelConfig(tensor_parallel_size=2, master_port=0, join_timeout_s=30.0)
    for i in range(2):
        argv, cfg = spawned_config(cluster, "decode", i)
        assert cfg.engine.parallel == ParallelConfig() and "--tensor-parallel-size" not in argv  # TP 1: as before
    # a flag wins over the file
    spec, _, _ = cluster_spec(_with_config(build_parser(), ["serve", "--config", str(config), "-tp", "4"]))
    assert (spec.tp("prefill"), spec.tp("decode")) == (4, 1)
    _, cfg = spawned_config(LocalCluster(spec, run_dir=str(tmp_path / "run")), "prefill", 0)
    assert cfg.engine.parallel.tensor_parallel_size == 4


def test_engine_devices_step_by_the_tensor_parallel_size():
    def devices(**kw):
        c = LocalCluster(ClusterSpec(model="m", device="cuda", num_prefill=2, num_decode=2, **kw))
        return [
            opt(c._engine_args(r, i, c.spec.first_device(r, i)), "--device")
            for r in ("prefill", "decode")
            for i in range(2)
        ]

    assert devices() == ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    assert devices(tensor_parallel_size=2) == ["cuda:0", "cuda:2", "cuda:4", "cuda:6"]
    assert devices(prefill_tensor_parallel_size=2) == ["cuda:0", "cuda:2", "cuda:4", "cuda:5"]
    assert devices(decode_tensor_parallel_size=4) == ["cuda:0", "cuda:1", "cuda:2", "cuda:6"]


def test_a_tensor_parallel_engine_takes_one_more_port_of_the_range():
    c = LocalCluster(
        ClusterSpec(model="m", num_prefill=1, num_decode=2, prefill_tensor_parallel_size=2, engine_ports=(20000, 20009))
    )
    got = [c._engine_args(r, i, 0) for r, i in (("prefill", 0), ("decode", 0))]
    assert [(opt(a, "--port"), opt(a, "--transport-port"), opt(a, "--tp-master-port")) for a in got] == [
        ("20000", "20001", "20003"),
        ("20004", "20005", None),
    ]
    with pytest.raises(ConfigError, match="room for 3 engines"):  # 20007-20009 fit a TP 1 engine; the next, none
        c._engine_args("decode", 1, 0), c._engine_args("decode", 2, 0)
    # no range: the TP engines' rendezvous ports from --tp-master-port up, or any free one
    c = LocalCluster(ClusterSpec(model="m", num_prefill=2, tensor_parallel_size=2, tp_master_port=29500))
    assert [opt(c._engine_args("prefill", i, 0), "--tp-master-port") for i in range(2)] == ["29500", "29501"]
    c = LocalCluster(ClusterSpec(model="m", tensor_parallel_size=2))
    assert opt(c._engine_args("decode", 0, 0), "--tp-master-port") == "0"


def test_serve_takes_a_master_port_or_a_port_range_not_both(llama):
    from dualpath.serving.serve import cluster_spec

    args = build_parser().parse_args(
        ["serve", "--model", str(llama), "-tp", "2", "--tp-master-port", "29500", "--engine-port-range", "20000-20100"]
    )
    with pytest.raises(ConfigError, match="give one"):
        cluster_spec(args)


def test_engine_flags():
    base = ["engine", "--role", "decode", "--model", "m", "--scheduler", "h:1"]
    assert engine_config(build_parser().parse_args(base)).engine.parallel == ParallelConfig()
    args = build_parser().parse_args([*base, "-tp", "2", "--tp-master-port", "29500", "--tp-join-timeout", "5"])
    assert engine_config(args).engine.parallel == ParallelConfig(2, 29500, 5.0)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        engine_config(build_parser().parse_args([*base, "--tensor-parallel-size", "0"]))


def test_node_engines_take_tp_devices_each():
    node = NodeEngines(
        NodeSpec("prefill", "h:1", engines=2, device="cuda", node_id="n", tensor_parallel_size=4, torch_threads=1)
    )
    argv = node.engine_args(1)
    assert opt(argv, "--device") == "cuda:4" and opt(argv, "--tensor-parallel-size") == "4"
    assert "--tensor-parallel-size" not in NodeEngines(
        NodeSpec("prefill", "h:1", device="cuda", torch_threads=1)
    ).engine_args(0)
    args = build_parser().parse_args(["node", "--role", "decode", "--scheduler", "h:1", "-tp", "2"])
    assert args.tensor_parallel_size == 2
    assert _node_tp(1, ["--dtype", "bfloat16", "-tp", "2"]) == 2 and _node_tp(1, ["--tensor-parallel-size=8"]) == 8
    assert _node_tp(4, ["-tp", "2"]) == 4 and _node_tp(1, ["--dtype", "bfloat16"]) == 1


def test_generate_passes_the_size_to_llm(monkeypatch, capsys):
    import dualpath

    made = {}

    class FakeLLM:
        def __init__(self, model, **kw):
            made.update(kw)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            made["closed"] = True

        def generate(self, prompts, params, lora_request=None):
            return []

    monkeypatch.setattr(dualpath, "LLM", FakeLLM)
    assert main(["generate", "--model", "m", "--prompt", "hi", "-tp", "2"]) == 0
    assert made["tensor_parallel_size"] == 2 and made["closed"]


# ---- deploy ----


def test_helm_gives_each_engine_its_gpus():
    from k8s_tools import helm_binary

    helm = helm_binary()
    if helm is None:
        pytest.skip("helm unavailable")
    chart = ROOT / "deploy/k8s/dualpath"

    def render(*sets: str):
        r = subprocess.run(
            [helm, "template", "dp", str(chart), *(x for s in sets for x in ("--set", s))],
            check=False,
            capture_output=True,
            text=True,
            timeout=120,
        )
        return r, {
            (d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(r.stdout) if d
        } if not r.returncode else {}

    r, objs = render("prefill.tensorParallelSize=2", "decode.gpusPerNode=4", "decode.tensorParallelSize=4")
    assert r.returncode == 0, r.stderr
    for role, engines, tp, gpus in (("prefill", 4, 2, 8), ("decode", 1, 4, 4)):
        pod = objs[("StatefulSet", f"dp-dualpath-{role}")]["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
        args = build_parser().parse_args(c["command"][1:])
        assert (args.engines, args.tensor_parallel_size) == (engines, tp)
        ports = objs[("NetworkPolicy", f"dp-dualpath-{role}")]["spec"]["ingress"][0]["ports"][0]
        assert ports.get("endPort", ports["port"]) == ports["port"] + engines - 1
    wait = objs[("Deployment", "dp-dualpath-frontend")]["spec"]["template"]["spec"]["initContainers"]
    (cmd,) = [c["command"] for c in wait if c["name"] == "wait-for-engines"]
    assert (opt(cmd, "--wait-prefill"), opt(cmd, "--wait-decode")) == ("4", "1")
    r, objs = render()  # the default: one engine per GPU, no flag
    (c,) = objs[("StatefulSet", "dp-dualpath-prefill")]["spec"]["template"]["spec"]["containers"]
    assert "--tensor-parallel-size" not in c["command"] and opt(c["command"], "--engines") == "8"
    r, _ = render("prefill.tensorParallelSize=3")
    assert r.returncode and "prefill.tensorParallelSize 3 does not divide prefill.gpusPerNode 8" in r.stderr
    # MoE layouts: whole experts per rank (prefill at TP 2), a data-parallel group of each decode pod's 8 engines
    r, objs = render("prefill.tensorParallelSize=2", "prefill.expertParallel=true", "decode.dataParallel=true")
    assert r.returncode == 0, r.stderr
    for role, flag in (("prefill", "--enable-expert-parallel"), ("decode", "--data-parallel")):
        (c,) = objs[("StatefulSet", f"dp-dualpath-{role}")]["spec"]["template"]["spec"]["containers"]
        assert flag in c["command"] and {"--enable-expert-parallel", "--data-parallel"} - {flag} - set(c["command"])
        args = build_parser().parse_args(c["command"][1:])
        assert args.data_parallel == (role == "decode")
    r, _ = render("decode.tensorParallelSize=2", "decode.dataParallel=true")
    assert r.returncode and "decode.dataParallel runs one GPU per engine" in r.stderr


SLURM = r"""
set -uo pipefail
source "$CLUSTER_SH"
dp_check_tp; echo "check=$?"
[ "${RUN:-0}" = 0 ] || { dp_run_engines prefill node1 1; wait $!; dp_run_engines decode node2 1; wait $!; }
"""


def slurm(tmp_path: Path, **env: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "srun").write_text(f'#!/bin/sh\necho "$@" >>"{tmp_path}/srun.args"\n')
    (bin_dir / "srun").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("DUALPATH")}
    r = subprocess.run(
        ["bash", "-c", SLURM],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **base,
            "CLUSTER_SH": str(ROOT / "deploy/slurm/cluster.sh"),
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "DUALPATH_RUN_DIR": str(tmp_path),
            "DUALPATH_GPUS_PER_NODE": "8",
            **env,
        },
    )
    return r.stdout + r.stderr


def test_slurm_engines_span_tp_gpus_each(tmp_path):
    out = slurm(tmp_path, DUALPATH_TP="2", DUALPATH_DECODE_TP="1", RUN="1")
    assert "check=0" in out and "starting prefill engines on node1 (4 per node, tensor-parallel size 2)" in out, out
    prefill, decode = (tmp_path / "srun.args").read_text().split("--export=ALL")[1:]
    assert "--ntasks-per-node=4 --gpus-per-task=2 --cpus-per-task=2" in prefill and prefill.rstrip().endswith(
        "prefill 2"
    )
    assert "--ntasks-per-node=8 --gpus-per-task=1 --cpus-per-task=1" in decode and decode.rstrip().endswith("decode 1")
    assert '--tensor-parallel-size "$1"' in prefill
    out = slurm(tmp_path, DUALPATH_DATA_PARALLEL="1", DUALPATH_EXPERT_PARALLEL="1", RUN="1")
    decode = (tmp_path / "srun.args").read_text().split("--export=ALL")[-1]
    assert "--data-parallel-rank $SLURM_LOCALID" in decode and "--enable-expert-parallel" in decode
    assert "check=2" in slurm(tmp_path, DUALPATH_DATA_PARALLEL="1", DUALPATH_DECODE_TP="2")
    out = slurm(tmp_path, DUALPATH_TP="3")
    assert "check=2" in out and "tensor-parallel size 3 (DUALPATH_TP, DUALPATH_PREFILL_TP) does not divide" in out
    assert "check=2" in slurm(tmp_path, DUALPATH_PREFILL_TP="0")
