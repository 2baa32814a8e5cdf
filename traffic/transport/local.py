"""``local``: transports in one process, found through a ``LocalHub``; a transfer is a plain copy."""

from __future__ import annotations

from dualpath.core.config import TransportConfig
from dualpath.core.errors import PeerDeadError
from dualpath.traffic.transport.base import Op, Priority, Segment, Transport, copy_bytes


class LocalHub:
    """Who is reachable in this process. Create one and give it to every ``LocalTransport`` that should talk."""

    def __init__(self):
        self.endpoints: dict[str, "LocalTransport"] = {}


class LocalTransport(Transport):
    name = "local"

    def __init__(self, config: TransportConfig, endpoint: str, hub: LocalHub):
        super().__init__(config, endpoint)
        self.hub = hub
        hub.endpoints[endpoint] = self

    def address(self) -> dict:
        return {"endpoint": self.endpoint}

    def _connect(self, peer: str, address: dict, priority: Priority) -> "LocalTransport":
        target = self.hub.endpoints.get(address["endpoint"])
        if target is None:
            raise PeerDeadError(f"local peer {peer} is not in the hub")
        return target

    def _check_peer(self, peer: str, conn: "LocalTransport") -> None:
        if conn._closed:
            raise PeerDeadError(f"local peer {peer} is closed")

    def _execute(self, conn: "LocalTransport", op: Op, segments: list[Segment]) -> None:
        for s in segments:
            local = self._regions[s.local_region].tensor[s.local_offset : s.local_offset + s.nbytes]
            remote = conn._regions[s.remote_region].tensor[s.remote_offset : s.remote_offset + s.nbytes]
            if op is Op.READ:
                copy_bytes(local, remote)
            else:
                copy_bytes(remote, local)

    def _close_backend(self) -> None:
        self.hub.endpoints.pop(self.endpoint, None)
