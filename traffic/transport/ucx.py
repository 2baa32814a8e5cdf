"""``ucx``: UCX through the ``ucxx`` bindings, over whatever UCX finds (tcp, shared memory, RDMA verbs).

The ``ucxx`` Python bindings expose no remote memory access (no rkeys), so one-sided semantics are served by a
transport thread in the peer: each request is a fixed header on an ordered UCX stream, followed by the payload
(WRITE) or answered with a status and the payload (READ); payloads move straight between the registered regions
and UCX, with no staging copy. Each priority class has its own UCX context, listener and endpoints, so KV
traffic can sit on its own InfiniBand service level / RoCE traffic class (``UCX_IB_SL``,
``UCX_IB_TRAFFIC_CLASS``) where UCX has verbs; elsewhere the settings are reported as not applied.

Over TCP the KV context's sockets carry ``kv_traffic_class`` as their ``IP_TOS``. UCX has no option for it, so
the transport marks them itself (``dualpath.traffic.qos.SocketMarker``): the ports the KV context listens on (its listener
and its ``tcp`` interfaces, found as the ports that appeared while it was created) are marked at once, so every
connection a peer opens to them is marked from its first packet; the connections this side opens to a peer's KV
ports (``kv_ports`` in its address) are marked as they appear: after connecting, and after transfers.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import torch

from dualpath.core.config import TransportConfig
from dualpath.core.errors import ConfigError, PeerDeadError, TransferTimeoutError, TransportError
from dualpath.traffic import qos
from dualpath.traffic.transport.base import Op, Priority, Segment, Transport

log = logging.getLogger(__name__)

_READ, _WRITE = 1, 2
_FIRST_MARK_S = 0.002  # how often a KV lane's first transfer looks for the data connection UCX opens for it
_OK, _BAD_SEGMENT = 0, 1


def _ucx():
    try:
        import ucxx._lib.libucxx as ucx_api
        from ucxx._lib.arr import Array
    except ImportError as e:
        raise ConfigError(f"the ucx transport needs ucxx: pip install ucxx-cu12 ({e})") from None
    return ucx_api, Array


def _buffer(t: torch.Tensor):
    """What UCX sends from or receives into: a numpy view of host bytes, the tensor itself on a GPU."""
    return t.numpy() if t.device.type == "cpu" else t


class _Worker:
    """One UCX context + worker (with its progress thread) + listener for one priority class."""

    def __init__(self, transport: "UcxTransport", priority: Priority, config: dict):
        ucx_api, _ = _ucx()
        flags = (ucx_api.Feature.STREAM, ucx_api.Feature.WAKEUP)
        self.applied = bool(config)
        try:
            self.ctx = ucx_api.UCXContext(config_dict=config, feature_flags=flags)
        except Exception:  # noqa: BLE001 - this UCX has no IB module: the SL/TC keys do not exist
            self.ctx = ucx_api.UCXContext(config_dict={}, feature_flags=flags)
            self.applied = False
        self.worker = ucx_api.UCXWorker(self.ctx)
        self.worker.start_progress_thread(polling_mode=False)
        self.transport, self.priority = transport, priority
        self.server_eps: list = []
        base = transport.config.listen_port  # HIGH on it, LOW on the next: every port known in advance
        port = base + (priority is Priority.LOW) if base else 0
        self.listener = ucx_api.UCXListener.create(worker=self.worker, port=port, cb_func=self._accept)

    def _accept(self, conn_request) -> None:
        ep = self.listener.create_endpoint_from_conn_request(conn_request, True)
        self.server_eps.append(ep)
        threading.Thread(
            target=self.transport._serve, args=(ep,), daemon=True, name=f"ucx-serve-{self.priority.name.lower()}"
        ).start()

    def close(self) -> None:
        for ep in self.server_eps:
            try:
                ep.close()
            except Exception:  # noqa: BLE001
                pass
        self.worker.stop_progress_thread()


class _Endpoint:
    """A lane's UCX endpoint and its class."""

    def __init__(self, ep, priority: Priority):
        self.ep, self.priority = ep, priority
        self.transfers = 0  # counted for KV lanes only (see UcxTransport._mark_kv)


class UcxTransport(Transport):
    name = "ucx"

    def __init__(self, config: TransportConfig, endpoint: str):
        super().__init__(config, endpoint)
        kv = {"IB_SL": str(config.kv_service_level), "IB_TRAFFIC_CLASS": str(config.kv_traffic_class)}
        high = _Worker(self, Priority.HIGH, {})
        before = qos.listening_ports()
        low = _Worker(self, Priority.LOW, kv)
        self._workers = {Priority.HIGH: high, Priority.LOW: low}
        # the KV context's own ports: its listener's, and its tcp interfaces' (opened with its worker)
        kv_ports = (qos.listening_ports() - before - {high.listener.port}) | {low.listener.port}
        self.kv_marker = qos.SocketMarker(config.kv_traffic_class, kv_ports)
        if config.kv_traffic_class:
            self.kv_marker.mark(force=True)
        self.kv_qos_applied = low.applied
        if not self.kv_qos_applied:
            log.info(
                "ucx: this UCX has no InfiniBand support; KV service level %d not applied", config.kv_service_level
            )

    def address(self) -> dict:
        return {
            "host": self.config.host,
            "ports": {p.name: w.listener.port for p, w in self._workers.items()},
            "kv_ports": sorted(self.kv_marker.local_ports),
        }

    # --- initiator ------------------------------------------------------------------------------------------
    def _connect(self, peer: str, address: dict, priority: Priority):
        ucx_api, _ = _ucx()
        worker = self._workers[priority].worker
        if priority is Priority.LOW:
            self.kv_marker.add_remote_ports(address.get("kv_ports", [address["ports"]["LOW"]]))
        try:
            ep = ucx_api.UCXEndpoint.create(worker, address["host"], int(address["ports"][priority.name]), True)
        except Exception as e:  # noqa: BLE001
            raise PeerDeadError(f"ucx: cannot connect to {peer} at {address}: {e}") from None
        conn = _Endpoint(ep, priority)
        self._mark_kv(conn)
        return conn

    def _mark_kv(self, conn: "_Endpoint") -> None:
        """Mark the KV context's TCP connections: at once after connecting (the connection to the peer's listener),
        every few milliseconds during the lane's first transfer and once after it (the data connection UCX opens
        meanwhile, which that transfer uses: marked within those milliseconds), then at most once per interval (a
        connection UCX opened again)."""
        if conn.priority is Priority.HIGH or not self.config.kv_traffic_class:
            return
        self.kv_marker.mark(force=conn.transfers < 2)
        conn.transfers += 1

    def _poll_marks(self, conn: "_Endpoint"):
        """What ``_wait`` calls while it polls: during a KV lane's first transfer, a look for new connections every
        ``_FIRST_MARK_S``."""
        if conn.priority is Priority.HIGH or conn.transfers > 1 or not self.config.kv_traffic_class:
            return None
        last = [time.monotonic()]

        def poll():
            now = time.monotonic()
            if now - last[0] >= _FIRST_MARK_S:
                last[0] = now
                self.kv_marker.mark(force=True)

        return poll

    def _check_peer(self, peer: str, conn: "_Endpoint") -> None:
        if not conn.ep.alive:
            raise PeerDeadError(f"ucx endpoint to {peer} is closed")

    def _wait(self, requests, what: str, poll=None) -> None:
        deadline = time.monotonic() + self.config.op_timeout_s
        pause = 1e-5
        while not all(r.completed for r in requests):
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"ucx: {what} not done after {self.config.op_timeout_s} s")
            if poll is not None:
                poll()
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)
        for r in requests:
            try:
                r.check_error()
            except Exception as e:  # noqa: BLE001 - UCX reports a dead peer as a request error
                raise PeerDeadError(f"ucx: {what} failed: {e}") from None

    def _execute(self, conn: "_Endpoint", op: Op, segments: list[Segment]) -> None:
        _, Array = _ucx()
        ep = conn.ep
        keep, requests, statuses = [], [], np.zeros(len(segments), dtype=np.uint64)
        for i, s in enumerate(segments):
            local = self._regions[s.local_region].tensor[s.local_offset : s.local_offset + s.nbytes]
            header = np.array(
                [_READ if op is Op.READ else _WRITE, s.remote_region, s.remote_offset, s.nbytes], dtype=np.uint64
            )
            keep += [header, local]
            requests.append(ep.stream_send(Array(header)))
            if op is Op.WRITE:
                requests.append(ep.stream_send(Array(_buffer(local))))
                requests.append(ep.stream_recv(Array(statuses[i : i + 1])))
            else:
                requests.append(ep.stream_recv(Array(statuses[i : i + 1])))
                requests.append(ep.stream_recv(Array(_buffer(local))))
        self._wait(requests, f"{op.value} of {len(segments)} segments", self._poll_marks(conn))
        self._mark_kv(conn)
        if statuses.any():
            raise TransportError(f"ucx: the peer rejected {int((statuses != 0).sum())} segments")

    # --- target ---------------------------------------------------------------------------------------------
    def _serve(self, ep) -> None:
        """Answer one initiator's requests until its endpoint closes."""
        _, Array = _ucx()
        header = np.zeros(4, dtype=np.uint64)
        status = np.zeros(1, dtype=np.uint64)
        while not self._closed:
            try:
                self._wait_forever(ep.stream_recv(Array(header)))
                op, rid, off, n = (int(x) for x in header)
                region = self._regions.get(rid)
                ok = region is not None and off + n <= region.nbytes
                target = region.tensor[off : off + n] if ok else torch.empty(n, dtype=torch.uint8)
                status[0] = _OK if ok else _BAD_SEGMENT
                if op == _WRITE:
                    self._wait_forever(ep.stream_recv(Array(_buffer(target))))
                    self._wait_forever(ep.stream_send(Array(status)))
                else:
                    self._wait_forever(ep.stream_send(Array(status)))
                    self._wait_forever(ep.stream_send(Array(_buffer(target))))
            except Exception:  # noqa: BLE001 - the initiator went away
                return

    def _wait_forever(self, request) -> None:
        pause = 1e-5
        while not request.completed:
            if self._closed:
                raise TransportError("closed")
            time.sleep(pause)
            pause = min(pause * 2, 2e-4)
        request.check_error()

    def _close_backend(self) -> None:
        for w in self._workers.values():
            w.close()
