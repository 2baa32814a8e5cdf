"""``verbs``: RDMA READ/WRITE on RC queue pairs through pyverbs (rdma-core's Python bindings).

Every queue pair carries its class's service level (KV: ``kv_service_level``, which the subnet manager's QoS
tables map to a low-priority virtual lane) and, on RoCE, the traffic class in its global route header. Each
region is registered as a memory region; GPU memory is registered as dma-buf where the driver offers it, else
by address (nvidia-peermem). Queue pairs are connected on first use through a small TCP exchange of QP numbers,
LIDs and GIDs (the part rdma_cm would do).

Without an RDMA device this backend cannot run; building it raises a ``ConfigError``. What can be checked
without one is checked in the tests: queue-pair attributes carry the configured service level, and segments map
to the right work requests (``qp_attr`` and ``work_requests`` are pure functions of plain data).
"""

from __future__ import annotations

import json
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass

from dualpath.core.config import TransportConfig
from dualpath.core.errors import ConfigError, PeerDeadError, TransferTimeoutError
from dualpath.traffic.transport.base import Op, Priority, Region, Segment, Transport

_DEBIAN_DIST = "/usr/lib/python3/dist-packages"


def import_pyverbs():
    """pyverbs comes from rdma-core (Debian: python3-pyverbs), not PyPI wheels; look there too."""
    try:
        import pyverbs  # noqa: F401
    except ImportError:
        if os.path.isdir(os.path.join(_DEBIAN_DIST, "pyverbs")) and _DEBIAN_DIST not in sys.path:
            sys.path.append(_DEBIAN_DIST)  # appended: site-packages keeps precedence
        try:
            import pyverbs  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"the verbs transport needs pyverbs (apt install python3-pyverbs): {e}") from None
    import pyverbs.addr
    import pyverbs.cq
    import pyverbs.device
    import pyverbs.enums
    import pyverbs.mr
    import pyverbs.pd
    import pyverbs.qp
    import pyverbs.wr

    return pyverbs


@dataclass(frozen=True)
class QPInfo:
    """What one side tells the other to connect an RC queue pair."""

    qp_num: int
    lid: int
    gid: str  # "" when the link layer is InfiniBand without GRH
    psn: int


def qp_attr(config: TransportConfig, priority: Priority, remote: QPInfo, local_psn: int, port: int = 1):
    """Attributes for the RTR/RTS transitions of a queue pair of class ``priority`` towards ``remote``: it expects
    the peer's packets from ``remote.psn`` and sends its own from ``local_psn``, the PSN it told the peer (an RC
    responder drops packets whose PSN is not the one it expects, and the requester's retries run out).

    KV (low priority) queue pairs get ``kv_service_level`` (and ``kv_traffic_class`` on RoCE); control queue
    pairs keep service level 0, the high-priority lane.
    """
    pv = import_pyverbs()
    e = pv.enums
    attr = pv.qp.QPAttr(qp_state=e.IBV_QPS_RTR)
    attr.path_mtu = e.IBV_MTU_4096
    attr.dest_qp_num = remote.qp_num
    attr.rq_psn = remote.psn
    attr.max_dest_rd_atomic = 16
    attr.min_rnr_timer = 12
    attr.timeout = 14
    attr.retry_cnt = 7
    attr.rnr_retry = 7
    attr.sq_psn = local_psn
    attr.max_rd_atomic = 16
    kv = priority is Priority.LOW
    sl = config.kv_service_level if kv else 0
    if remote.gid:  # RoCE (or routed IB): the traffic class rides in the global route header
        gr = pv.addr.GlobalRoute(
            dgid=pv.addr.GID(remote.gid),
            sgid_index=config.gid_index,
            hop_limit=64,
            traffic_class=config.kv_traffic_class if kv else 0,
        )
        ah = pv.addr.AHAttr(dlid=remote.lid, sl=sl, port_num=port, is_global=1, gr=gr)
    else:
        ah = pv.addr.AHAttr(dlid=remote.lid, sl=sl, port_num=port)
    attr.ah_attr = ah
    return attr


def work_requests(
    op: Op, segments: list[Segment], local: dict[int, tuple[int, int]], remote: dict[int, tuple[int, int]]
):
    """One RDMA work request per segment, chained, only the last signaled.

    ``local[region] = (address, lkey)``, ``remote[region] = (address, rkey)``.
    """
    pv = import_pyverbs()
    e = pv.enums
    opcode = e.IBV_WR_RDMA_READ if op is Op.READ else e.IBV_WR_RDMA_WRITE
    wrs = []
    for i, s in enumerate(segments):
        laddr, lkey = local[s.local_region]
        raddr, rkey = remote[s.remote_region]
        sge = pv.wr.SGE(laddr + s.local_offset, s.nbytes, lkey)
        last = i == len(segments) - 1
        wr = pv.wr.SendWR(wr_id=i, opcode=opcode, num_sge=1, sg=[sge], send_flags=e.IBV_SEND_SIGNALED if last else 0)
        wr.set_wr_rdma(rkey, raddr + s.remote_offset)
        if wrs:
            wrs[-1].next_wr = wr
        wrs.append(wr)
    return wrs


class VerbsTransport(Transport):
    name = "verbs"

    def __init__(self, config: TransportConfig, endpoint: str):
        super().__init__(config, endpoint)
        pv = import_pyverbs()
        try:
            devices = pv.device.get_device_list()
        except Exception as e:  # noqa: BLE001 - pyverbs raises when the kernel has no RDMA support
            raise ConfigError(f"verbs transport: no RDMA devices on this machine ({e})") from None
        names = [d.name.decode() for d in devices]
        name = config.device_name or (names[0] if names else None)
        if name not in names:
            raise ConfigError(f"verbs transport: RDMA device {name!r} not found (have {names})")
        self.ctx = pv.device.Context(name=name)
        self.pd = pv.pd.PD(self.ctx)
        self.port_attr = self.ctx.query_port(1)
        self._mrs: dict[int, object] = {}
        self._cm = socket.create_server((config.host, 0))
        self._cm_thread = threading.Thread(target=self._serve_cm, daemon=True, name="verbs-cm")
        self._cm_thread.start()
        self._accepted: list = []

    # --- memory ---------------------------------------------------------------------------------------------
    def _describe(self, region: Region) -> dict:
        mr = self._mrs.get(region.region_id)
        if mr is None:
            mr = self._mrs[region.region_id] = self._register_mr(region)
        return {"rkey": mr.rkey, "lkey": mr.lkey}

    def _register_mr(self, region: Region):
        pv = import_pyverbs()
        e = pv.enums
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_READ | e.IBV_ACCESS_REMOTE_WRITE
        t = region.tensor
        if t.device.type == "cuda":
            fd = _cuda_dmabuf_fd(t.data_ptr(), t.numel())
            if fd is not None:
                return pv.mr.DmaBufMR(self.pd, t.numel(), access, fd=fd, offset=0)
        return pv.mr.MR(self.pd, t.numel(), access, address=t.data_ptr())

    # --- queue pairs ----------------------------------------------------------------------------------------
    def _new_qp(self):
        pv = import_pyverbs()
        e = pv.enums
        cq = pv.cq.CQ(self.ctx, 4096)
        cap = pv.qp.QPCap(max_send_wr=4096, max_recv_wr=1, max_send_sge=1, max_recv_sge=1)
        init = pv.qp.QPInitAttr(qp_type=e.IBV_QPT_RC, scq=cq, rcq=cq, cap=cap)
        qp = pv.qp.QP(self.pd, init, pv.qp.QPAttr())
        return qp, cq

    def _my_info(self, qp) -> QPInfo:
        gid = str(self.ctx.query_gid(1, self.config.gid_index)) if self.port_attr.lid == 0 else ""
        return QPInfo(qp.qp_num, self.port_attr.lid, gid, random.randrange(1 << 24))

    def address(self) -> dict:
        return {"host": self.config.host, "cm_port": self._cm.getsockname()[1]}

    def _connect(self, peer: str, address: dict, priority: Priority):
        qp, cq = self._new_qp()
        mine = self._my_info(qp)
        try:
            with socket.create_connection((address["host"], address["cm_port"]), self.config.op_timeout_s) as s:
                s.sendall((json.dumps({"qp": mine.__dict__, "priority": priority.name}) + "\n").encode())
                theirs = QPInfo(**json.loads(s.makefile().readline())["qp"])
        except OSError as e:
            raise PeerDeadError(f"verbs: cannot reach {peer}'s connection manager: {e}") from None
        qp.to_rts(qp_attr(self.config, priority, theirs, mine.psn))
        return peer, qp, cq

    def _serve_cm(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._cm.accept()
            except OSError:
                return
            with conn:
                req = json.loads(conn.makefile().readline())
                qp, cq = self._new_qp()
                mine = self._my_info(qp)
                qp.to_rts(qp_attr(self.config, Priority[req["priority"]], QPInfo(**req["qp"]), mine.psn))
                self._accepted.append((qp, cq))
                conn.sendall((json.dumps({"qp": mine.__dict__}) + "\n").encode())

    def _execute(self, conn, op: Op, segments: list[Segment]) -> None:
        peer, qp, cq = conn
        local = {
            s.local_region: (
                self._regions[s.local_region].tensor.data_ptr(),
                self.describe(s.local_region).extra["lkey"],
            )
            for s in segments
        }
        remote = {
            s.remote_region: (
                self.remote_desc(peer, s.remote_region).address,
                self.remote_desc(peer, s.remote_region).extra["rkey"],
            )
            for s in segments
        }
        wrs = work_requests(op, segments, local, remote)
        qp.post_send(wrs[0])
        deadline = time.monotonic() + self.config.op_timeout_s
        while True:
            n, wcs = cq.poll()
            if n:
                if wcs[0].status != 0:
                    raise PeerDeadError(f"verbs: work request failed with status {wcs[0].status}")
                return
            if time.monotonic() > deadline:
                raise TransferTimeoutError(f"verbs: no completion after {self.config.op_timeout_s} s")

    def _close_backend(self) -> None:
        self._cm.close()
        for mr in self._mrs.values():
            mr.close()
        self.pd.close()
        self.ctx.close()


def _cuda_dmabuf_fd(ptr: int, nbytes: int) -> int | None:
    """A dma-buf file descriptor for device memory, where the CUDA driver exports one."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    err, fd = driver.cuMemGetHandleForAddressRange(
        ptr, nbytes, driver.CUmemRangeHandleType.CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0
    )
    return int(fd) if err == driver.CUresult.CUDA_SUCCESS else None
