"""Hosts on one machine for multi-host tests: a network namespace per host, each with one veth into a bridge in the
root namespace (10.213.0.0/24; the root namespace is 10.213.0.254), optionally rate-limited with tc. Needs root."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

SUBNET = "10.213.0"


def netns_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = f"dpprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if r.returncode:
        return f"cannot create network namespaces: {r.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    ip: str
    dev: str  # its interface, inside the namespace

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def tx_bytes(self) -> int:
        """Bytes sent through this host's (possibly shaped) interface."""
        out = sh(*self.exec_prefix(), "cat", f"/sys/class/net/{self.dev}/statistics/tx_bytes").stdout
        return int(out)


class Hosts:
    """``names`` hosts; ``rates`` maps a host to a tc rate ("200mbit") on its egress."""

    def __init__(self, names: list[str], rates: dict[str, str] | None = None):
        tag = str(os.getpid() % 100000)
        self.bridge = f"dpbr{tag}"
        self.hosts = {n: Host(f"dp{tag}{n}", f"{SUBNET}.{i + 1}", "eth0") for i, n in enumerate(names)}
        self.rates = rates or {}
        self._veths: list[str] = []

    def up(self) -> "Hosts":
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{SUBNET}.254/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for i, (name, h) in enumerate(self.hosts.items()):
                outer = f"{self.bridge}v{i}"
                sh("ip", "netns", "add", h.name)
                sh("ip", "link", "add", outer, "type", "veth", "peer", "name", h.dev, "netns", h.name)
                self._veths.append(outer)
                sh("ip", "link", "set", outer, "master", self.bridge, "up")
                ns = h.exec_prefix()
                sh(*ns, "ip", "addr", "add", f"{h.ip}/24", "dev", h.dev)
                sh(*ns, "ip", "link", "set", h.dev, "up")
                sh(*ns, "ip", "link", "set", "lo", "up")
                if name in self.rates:  # token bucket on the host's egress: its NIC's bandwidth
                    sh(
                        *ns,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        h.dev,
                        "root",
                        "tbf",
                        "rate",
                        self.rates[name],
                        "burst",
                        "64kb",
                        "latency",
                        "400ms",
                    )
        except BaseException:
            self.down()
            raise
        return self

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def qdisc(self, name: str) -> str:
        h = self.hosts[name]
        return sh(*h.exec_prefix(), "tc", "-s", "qdisc", "show", "dev", h.dev).stdout

    def down(self) -> None:
        for h in self.hosts.values():
            sh("ip", "netns", "del", h.name, check=False)
        for v in self._veths:
            sh("ip", "link", "del", v, check=False)
        sh("ip", "link", "del", self.bridge, check=False)
