"""A fake RDMA device behind pyverbs' interface (the part ``dualpath.traffic.transport.verbs`` calls), for tests on
machines without one. Never the default: a test installs it by patching ``verbs.import_pyverbs`` to return
``FakeFabric(...).pyverbs``.

What it emulates, as rdma-core and the InfiniBand spec define it, is what the transport relies on:
- devices, contexts, ports (a LID on InfiniBand; LID 0 and a GID on RoCE), protection domains;
- memory regions with an lkey and an rkey, checked on every access: key known, range inside the region, region
  of the queue pair's protection domain, access flags (a local fault completes with ``IBV_WC_LOC_PROT_ERR``, a
  remote one with ``IBV_WC_REM_ACCESS_ERR``);
- RC queue pairs, connected by ``to_rts`` to the remote QP number, addressed by LID (or by GID in the global
  route on RoCE) and with packet sequence numbers: a requester's send PSN must be the PSN its responder expects,
  else the responder drops its packets and the request fails after its retries (``IBV_WC_RETRY_EXC_ERR``);
- ``post_send`` of a chain of RDMA READ/WRITE work requests (one SGE each), executed in order on a wire thread:
  the bytes move, one completion per signaled work request; a failed one completes with its error whether
  signaled or not, and leaves the queue pair in error (later ones complete with ``IBV_WC_WR_FLUSH_ERR``);
- ``CQ.poll()`` returning ``(npolled, [work completion])``.
``FakeFabric.cut`` drops everything on the wire (no completion ever comes). Every chain posted is recorded in
``FakeFabric.posted``."""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
from collections import deque
from types import SimpleNamespace


class Enums:
    IBV_WR_RDMA_WRITE = 0
    IBV_WR_RDMA_READ = 4
    IBV_SEND_SIGNALED = 2
    IBV_QPS_RTR = 2
    IBV_QPS_RTS = 3
    IBV_MTU_4096 = 5
    IBV_QPT_RC = 2
    IBV_ACCESS_LOCAL_WRITE = 1
    IBV_ACCESS_REMOTE_WRITE = 2
    IBV_ACCESS_REMOTE_READ = 4
    IBV_WC_SUCCESS = 0
    IBV_WC_LOC_PROT_ERR = 4
    IBV_WC_WR_FLUSH_ERR = 5
    IBV_WC_REM_ACCESS_ERR = 10
    IBV_WC_RETRY_EXC_ERR = 12
    IBV_WC_RDMA_WRITE = 1
    IBV_WC_RDMA_READ = 2


PSN_MASK = (1 << 24) - 1


class FakeVerbsError(RuntimeError):
    """What pyverbs raises (``PyverbsRDMAError``) when a verb itself fails."""


class _Attrs:
    """A pyverbs attribute object: fields given as keywords, set later as attributes."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


# --- pyverbs.wr, pyverbs.addr, pyverbs.qp's attribute objects -------------------------------------------------
class SGE:
    def __init__(self, addr: int, length: int, lkey: int):
        self.addr, self.length, self.lkey = addr, length, lkey


class SendWR:
    def __init__(self, wr_id=0, opcode=0, num_sge=0, sg=None, send_flags=0):
        self.wr_id, self.opcode, self.num_sge, self.sg, self.send_flags = (
            wr_id,
            opcode,
            num_sge,
            list(sg or []),
            send_flags,
        )
        self.rkey = self.remote_addr = None
        self.next_wr = None

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rkey, self.remote_addr = rkey, addr


class GID:
    def __init__(self, val: str):
        self.gid = val

    def __str__(self) -> str:
        return self.gid


class GlobalRoute(_Attrs):
    def __init__(self, dgid=None, sgid_index=0, hop_limit=1, traffic_class=0, flow_label=0):
        super().__init__(
            dgid=dgid, sgid_index=sgid_index, hop_limit=hop_limit, traffic_class=traffic_class, flow_label=flow_label
        )


class AHAttr(_Attrs):
    def __init__(self, dlid=0, sl=0, port_num=1, is_global=0, gr=None, src_path_bits=0, static_rate=0):
        super().__init__(dlid=dlid, sl=sl, port_num=port_num, is_global=is_global, gr=gr, src_path_bits=src_path_bits)

    @property
    def traffic_class(self) -> int:
        return self.gr.traffic_class if self.gr is not None else 0

    @property
    def dgid(self) -> str:
        return str(self.gr.dgid) if self.gr is not None else ""


class QPCap(_Attrs):
    def __init__(self, max_send_wr=1, max_recv_wr=10, max_send_sge=1, max_recv_sge=1, max_inline_data=0):
        super().__init__(max_send_wr=max_send_wr, max_recv_wr=max_recv_wr, max_send_sge=max_send_sge)


class QPInitAttr(_Attrs):
    def __init__(self, qp_type=Enums.IBV_QPT_RC, scq=None, rcq=None, cap=None, sq_sig_all=0):
        super().__init__(qp_type=qp_type, scq=scq, rcq=rcq, cap=cap or QPCap(), sq_sig_all=sq_sig_all)


class QPAttr(_Attrs):
    def __init__(self, qp_state=0, **kw):
        super().__init__(qp_state=qp_state, **kw)


# --- the device -------------------------------------------------------------------------------------------------
class Context:
    def __init__(self, fabric: "FakeFabric", name: str):
        if name not in fabric.devices:
            raise FakeVerbsError(f"no device {name}")
        self.fabric, self.name = fabric, name
        self.lid = next(fabric._lids) if fabric.link_layer == "ib" else 0
        self.gid = f"fe80:0000:0000:0000:0000:0000:0000:{next(fabric._gids):04x}"
        self.closed = False

    def query_port(self, port: int):
        assert port == 1, "the fake device has one port"
        return SimpleNamespace(lid=self.lid, link_layer=self.fabric.link_layer)

    def query_gid(self, port: int, index: int) -> GID:
        return GID(self.gid)

    def close(self) -> None:
        self.closed = True


class PD:
    def __init__(self, ctx: Context):
        self.ctx, self.closed = ctx, False

    def close(self) -> None:
        self.closed = True


class MR:
    def __init__(self, pd: PD, length: int, access: int, address: int | None = None):
        assert address is not None, "the fake registers existing memory only (MR by address)"
        fabric = pd.ctx.fabric
        self.pd, self.length, self.access, self.buf = pd, length, access, address
        with fabric.lock:
            self.lkey, self.rkey = next(fabric._keys), next(fabric._keys)
            fabric.mrs[self.lkey] = fabric.mrs[self.rkey] = self

    def close(self) -> None:
        fabric = self.pd.ctx.fabric
        with fabric.lock:
            fabric.mrs.pop(self.lkey, None)
            fabric.mrs.pop(self.rkey, None)


class WC(_Attrs):
    pass


class CQ:
    def __init__(self, ctx: Context, cqe: int):
        self.ctx, self.cqe = ctx, cqe
        self._wcs: deque[WC] = deque()
        self._lock = threading.Lock()

    def _push(self, wc: WC) -> None:
        with self._lock:
            if len(self._wcs) >= self.cqe:
                raise FakeVerbsError("completion queue overrun")
            self._wcs.append(wc)

    def poll(self, num_entries: int = 1):
        with self._lock:
            out = [self._wcs.popleft() for _ in range(min(num_entries, len(self._wcs)))]
        return len(out), out

    def pending(self) -> int:
        """Completions not yet polled (a test's look)."""
        with self._lock:
            return len(self._wcs)


class QP:
    def __init__(self, pd: PD, init_attr: QPInitAttr, attr: QPAttr | None = None):
        fabric = pd.ctx.fabric
        self.pd, self.init, self.fabric = pd, init_attr, fabric
        self.state, self.error = "INIT", False
        self.remote_qpn = None
        self.sq_psn = self.rq_psn = 0
        self.ah = None
        self._wire: queue.Queue = queue.Queue()
        with fabric.lock:
            self.qp_num = next(fabric._qpns)
            fabric.qps[self.qp_num] = self

    def to_rts(self, attr: QPAttr) -> None:
        """INIT -> RTR -> RTS with ``attr``: the remote QP, its address, both PSNs."""
        fabric = self.fabric
        with fabric.lock:
            remote = fabric.qps.get(attr.dest_qp_num)
        if remote is None:
            raise FakeVerbsError(f"no QP {attr.dest_qp_num} on the fabric")
        ah, ctx = attr.ah_attr, remote.pd.ctx
        if ctx.lid:  # InfiniBand: routed by LID
            if ah.dlid != ctx.lid:
                raise FakeVerbsError(f"dlid {ah.dlid} is not QP {remote.qp_num}'s port (LID {ctx.lid})")
        elif not ah.is_global or ah.dgid != ctx.gid:  # RoCE: by GID, in the global route header
            raise FakeVerbsError(f"RoCE needs the global route to GID {ctx.gid}, got {ah.dgid or 'none'}")
        self.remote_qpn, self.ah, self.attr = remote.qp_num, ah, attr
        self.rq_psn, self.sq_psn = attr.rq_psn & PSN_MASK, attr.sq_psn & PSN_MASK
        self.state = "RTS"
        threading.Thread(target=self._run, daemon=True, name=f"fake-wire-{self.qp_num}").start()

    def post_send(self, wr: SendWR, bad_wr=None) -> None:
        if self.state != "RTS":
            raise FakeVerbsError(f"post_send on a QP in state {self.state}")
        chain = []
        while wr is not None:
            chain.append(wr)
            wr = wr.next_wr
        if len(chain) > self.init.cap.max_send_wr:
            raise FakeVerbsError(f"{len(chain)} work requests exceed the send queue's {self.init.cap.max_send_wr}")
        self.fabric.posted.append((self.qp_num, chain))
        self._wire.put(chain)

    # --- the wire ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            chain = self._wire.get()
            for wr in chain:
                if self.fabric.cut:
                    continue  # lost on the wire: no completion
                status = Enums.IBV_WC_WR_FLUSH_ERR if self.error else self._execute(wr)
                if status != Enums.IBV_WC_SUCCESS:
                    self.error = True
                if status != Enums.IBV_WC_SUCCESS or wr.send_flags & Enums.IBV_SEND_SIGNALED:
                    opcode = Enums.IBV_WC_RDMA_READ if wr.opcode == Enums.IBV_WR_RDMA_READ else Enums.IBV_WC_RDMA_WRITE
                    self.init.scq._push(WC(wr_id=wr.wr_id, status=status, opcode=opcode, qp_num=self.qp_num))

    def _execute(self, wr: SendWR) -> int:
        e, fabric = Enums, self.fabric
        with fabric.lock:
            remote = fabric.qps.get(self.remote_qpn)
            if remote is None or remote.state != "RTS" or remote.remote_qpn != self.qp_num:
                return e.IBV_WC_RETRY_EXC_ERR  # nobody answers
            if self.sq_psn != remote.rq_psn:  # out of sequence: the responder drops it, every retry too
                return e.IBV_WC_RETRY_EXC_ERR
            if wr.opcode not in (e.IBV_WR_RDMA_READ, e.IBV_WR_RDMA_WRITE) or (wr.num_sge, len(wr.sg)) != (1, 1):
                return e.IBV_WC_LOC_PROT_ERR
            (sge,) = wr.sg
            read = wr.opcode == e.IBV_WR_RDMA_READ
            local = fabric.mrs.get(sge.lkey)
            if not _covers(
                local, sge.lkey, "lkey", self.pd, sge.addr, sge.length, e.IBV_ACCESS_LOCAL_WRITE if read else 0
            ):
                return e.IBV_WC_LOC_PROT_ERR
            far = fabric.mrs.get(wr.rkey)
            need = e.IBV_ACCESS_REMOTE_READ if read else e.IBV_ACCESS_REMOTE_WRITE
            if not _covers(far, wr.rkey, "rkey", remote.pd, wr.remote_addr, sge.length, need):
                return e.IBV_WC_REM_ACCESS_ERR
            src, dst = (wr.remote_addr, sge.addr) if read else (sge.addr, wr.remote_addr)
            ctypes.memmove(dst, src, sge.length)
            self.sq_psn = remote.rq_psn = (self.sq_psn + 1) & PSN_MASK
            return e.IBV_WC_SUCCESS


def _covers(mr: MR | None, key: int, kind: str, pd: PD, addr: int, length: int, access: int) -> bool:
    if mr is None or getattr(mr, kind) != key or mr.pd is not pd:
        return False
    return mr.buf <= addr and addr + length <= mr.buf + mr.length and (mr.access & access) == access


class FakeFabric:
    """One fake device (or several) on one fake fabric, every QP of every context reachable from the others."""

    def __init__(self, link_layer: str = "ib", devices: tuple[str, ...] = ("fake_mlx5_0",)):
        assert link_layer in ("ib", "roce")
        self.link_layer, self.devices = link_layer, devices
        self.lock = threading.RLock()
        self.qps: dict[int, QP] = {}
        self.mrs: dict[int, MR] = {}
        self.posted: list[tuple[int, list[SendWR]]] = []  # (QP number, the chain) of every post_send
        self.cut = False
        self._keys, self._qpns = itertools.count(0x1000), itertools.count(0x40)
        self._lids, self._gids = itertools.count(1), itertools.count(1)
        fabric = self
        self.pyverbs = SimpleNamespace(
            device=SimpleNamespace(
                get_device_list=lambda: [SimpleNamespace(name=n.encode()) for n in fabric.devices],
                Context=lambda name: Context(fabric, name),
            ),
            pd=SimpleNamespace(PD=PD),
            mr=SimpleNamespace(MR=MR),
            cq=SimpleNamespace(CQ=CQ),
            qp=SimpleNamespace(QP=QP, QPAttr=QPAttr, QPCap=QPCap, QPInitAttr=QPInitAttr),
            wr=SimpleNamespace(SGE=SGE, SendWR=SendWR),
            addr=SimpleNamespace(AHAttr=AHAttr, GID=GID, GlobalRoute=GlobalRoute),
            enums=Enums,
        )

    def connected(self) -> list[QP]:
        with self.lock:
            return [qp for qp in self.qps.values() if qp.state == "RTS"]
