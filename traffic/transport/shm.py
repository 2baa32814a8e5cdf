"""``shm``: processes on one host. Remote regions live in POSIX shared memory that we map by name; a transfer
is a copy between our memory and the mapping. The default for single-host deployments."""

from __future__ import annotations

import os
import socket
import threading

from dualpath.core.config import TransportConfig
from dualpath.core.errors import PeerDeadError, TransportError
from dualpath.traffic.memory import HostMemory
from dualpath.traffic.transport.base import Op, Priority, Segment, Transport, copy_bytes


def process_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


class ShmTransport(Transport):
    name = "shm"
    remote_needs_shared_memory = True

    def __init__(self, config: TransportConfig, endpoint: str):
        super().__init__(config, endpoint)
        self._maps: dict[tuple[str, int], HostMemory] = {}
        self._maps_lock = threading.Lock()

    def address(self) -> dict:
        return {"pid": os.getpid(), "host": socket.gethostname()}

    def _connect(self, peer: str, address: dict, priority: Priority) -> tuple[str, int]:
        if address.get("host") != socket.gethostname():
            raise TransportError(
                f"shm transport cannot reach {peer} on host {address.get('host')}; use ucx or nixl across hosts"
            )
        return peer, int(address["pid"])

    def _check_peer(self, peer: str, conn: tuple[str, int]) -> None:
        if not process_alive(conn[1]):
            raise PeerDeadError(f"shm peer {peer} (pid {conn[1]}) is gone")

    def _mapping(self, peer: str, region_id: int) -> HostMemory:
        with self._maps_lock:
            mem = self._maps.get((peer, region_id))
            if mem is None:
                desc = self.remote_desc(peer, region_id)
                try:
                    mem = HostMemory.attach(desc.shm_name, desc.nbytes)
                except FileNotFoundError:
                    raise PeerDeadError(f"shared memory of {peer} region {region_id} is gone") from None
                self._maps[(peer, region_id)] = mem
            return mem

    def _execute(self, conn: tuple[str, int], op: Op, segments: list[Segment]) -> None:
        peer = conn[0]
        for s in segments:
            local = self._regions[s.local_region].tensor[s.local_offset : s.local_offset + s.nbytes]
            remote = self._mapping(peer, s.remote_region).tensor[s.remote_offset : s.remote_offset + s.nbytes]
            if op is Op.READ:
                copy_bytes(local, remote)
            else:
                copy_bytes(remote, local)

    def remove_peer(self, peer: str) -> None:
        super().remove_peer(peer)
        with self._maps_lock:
            for key in [k for k in self._maps if k[0] == peer]:
                self._maps.pop(key).close()

    def _close_backend(self) -> None:
        with self._maps_lock:
            for mem in self._maps.values():
                mem.close()
            self._maps.clear()
