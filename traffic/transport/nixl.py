"""``nixl``: a NIXL agent with its UCX backend; true one-sided READ/WRITE from descriptor lists.

Regions are registered with the agent (DRAM or VRAM); the agent's metadata travels in our address, and each
region's address in its descriptor, so a peer builds remote descriptor lists without asking us anything.
Note: processes that loaded NIXL must leave through ``os._exit`` (NIXL's destructors crash at interpreter exit).
"""

from __future__ import annotations

import base64
import time

import numpy as np

from dualpath.core.config import TransportConfig
from dualpath.core.errors import ConfigError, PeerDeadError, TransferTimeoutError, TransportError
from dualpath.traffic.transport.base import Op, Priority, Segment, Transport


def _nixl():
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise ConfigError(f"the nixl transport needs NIXL: pip install nixl-cu12 ({e})") from None
    return nixl_agent, nixl_agent_config


def _mem_type(device: str) -> str:
    return "DRAM" if device == "cpu" else "VRAM"


def _dev_id(device: str) -> int:
    return int(device.split(":")[1]) if ":" in device else 0


class NixlTransport(Transport):
    name = "nixl"

    def __init__(self, config: TransportConfig, endpoint: str):
        super().__init__(config, endpoint)
        nixl_agent, nixl_agent_config = _nixl()
        self.agent = nixl_agent(endpoint, nixl_agent_config(backends=["UCX"]))
        self._remote_agents: dict[str, str] = {}

    def register(self, memory):
        desc = super().register(memory)
        region = self._regions[desc.region_id]
        t = region.tensor
        self.agent.register_memory([(t.data_ptr(), t.numel(), _dev_id(str(t.device)), "")], _mem_type(t.device.type))
        # descriptors are sent once regions are registered, so the metadata must include this one
        return self.describe(desc.region_id)

    def address(self) -> dict:
        return {"agent": self.endpoint, "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}

    def _connect(self, peer: str, address: dict, priority: Priority) -> str:
        self._agent_of(peer)
        return peer

    def _agent_of(self, peer: str) -> str:
        """The peer's agent name, loading its metadata on first use (and again after ``add_peer``)."""
        with self._lock:
            name = self._remote_agents.get(peer)
            if name is None:
                name = self.agent.add_remote_agent(base64.b64decode(self._peer_address[peer]["metadata"]))
                self._remote_agents[peer] = name
            return name

    def add_peer(self, peer, address, regions) -> None:
        super().add_peer(peer, address, regions)
        with self._lock:
            old = self._remote_agents.pop(peer, None)
        if old is not None:  # new metadata (the peer registered more memory): reload it on next use
            self.agent.remove_remote_agent(old)

    def _execute(self, peer: str, op: Op, segments: list[Segment]) -> None:
        agent_name = self._agent_of(peer)
        local = np.array(
            [
                (
                    self._regions[s.local_region].tensor.data_ptr() + s.local_offset,
                    s.nbytes,
                    _dev_id(str(self._regions[s.local_region].tensor.device)),
                )
                for s in segments
            ],
            dtype=np.uint64,
        )
        remote_descs = [self.remote_desc(peer, s.remote_region) for s in segments]
        remote = np.array(
            [(d.address + s.remote_offset, s.nbytes, _dev_id(d.device)) for d, s in zip(remote_descs, segments)],
            dtype=np.uint64,
        )
        local_type = _mem_type(self._regions[segments[0].local_region].tensor.device.type)
        remote_type = _mem_type(remote_descs[0].device.split(":")[0])
        try:
            handle = self.agent.initialize_xfer(
                "READ" if op is Op.READ else "WRITE",
                self.agent.get_xfer_descs(local, local_type),
                self.agent.get_xfer_descs(remote, remote_type),
                agent_name,
            )
        except Exception as e:  # noqa: BLE001
            raise PeerDeadError(f"nixl: cannot start a transfer with {agent_name}: {e}") from None
        try:
            self._drive(handle, agent_name)
        finally:
            self.agent.release_xfer_handle(handle)

    def _drive(self, handle, agent_name: str) -> None:
        state = self.agent.transfer(handle)
        deadline = time.monotonic() + self.config.op_timeout_s
        pause = 1e-5
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TransferTimeoutError(
                    f"nixl: transfer with {agent_name} not done after {self.config.op_timeout_s} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)
            state = self.agent.check_xfer_state(handle)
        if state != "DONE":
            raise TransportError(f"nixl: transfer with {agent_name} failed ({state})")
