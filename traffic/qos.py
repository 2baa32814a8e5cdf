"""Priority classes on IP networks: the TOS / traffic-class byte (DSCP << 2) of this process's TCP sockets.

What marks what (``dualpath.core.config.QosConfig`` holds the numbers; ``deploy/qos/README.md`` the fabric's side):

- **InfiniBand**: the service level of each queue pair (``verbs`` sets the KV SL on its KV queue pairs; ``ucx``
  gives its KV context ``UCX_IB_SL``; NCCL's queue pairs take ``NCCL_IB_SL``). Nothing here.
- **RoCE**: the traffic class in each queue pair's global route header, DSCP << 2 (``verbs``: the QP attribute;
  ``ucx``: ``UCX_IB_TRAFFIC_CLASS``; NCCL: ``NCCL_IB_TC``). Nothing here either.
- **TCP**: ``IP_TOS`` (``IPV6_TCLASS`` on IPv6 sockets) per socket, set by whoever owns the socket. A transport
  whose sockets belong to a library with no such option (UCX's ``tcp`` transport has none: ``ucx_info -c`` lists no
  TOS or DSCP setting) marks them from outside: the kernel copies a listening socket's TOS into every connection
  it accepts, so listeners marked at creation cover the accepting side from its first packet (the SYN-ACK), and
  the connections a library opens are found by port among the process's sockets and marked once they exist
  (``SocketMarker``). Packets of a connection sent before its mark carry DSCP 0.

Marking only names a class; it is the network (switch queues, a host qdisc) that gives the classes their shares:
``bench/qos.py`` does it with ``htb`` classes filled by DSCP.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

log = logging.getLogger(__name__)


def tos_byte(dscp: int) -> int:
    """The TOS / traffic-class byte carrying ``dscp`` (its low two bits are ECN, left 0)."""
    if not 0 <= dscp <= 63:
        raise ValueError(f"a DSCP is 0..63, got {dscp}")
    return dscp << 2


def set_socket_tos(sock: socket.socket, tos: int) -> None:
    """Mark ``sock``'s packets with ``tos``. An IPv6 socket gets its traffic class, and its IPv4 TOS too: a
    dual-stack socket talking to an IPv4-mapped address sends IPv4 packets, which take ``IP_TOS``."""
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)


def socket_tos(sock: socket.socket) -> int:
    """The TOS byte ``sock``'s IPv4 packets carry (``IP_TOS``)."""
    return sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS)


def fd_tos(fd: int) -> int | None:
    """``socket_tos`` of the socket open on ``fd`` (which stays open); None if it closed since it was listed
    (another thread's connection may end at any time)."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        return socket_tos(s)
    except OSError:
        return None
    finally:
        s.close()


@dataclass(frozen=True)
class TcpSocket:
    """One TCP socket of this process: an fd it is open on, its ports (``remote_port`` 0: not connected)."""

    fd: int
    local_port: int
    remote_port: int
    listening: bool


def _socket_fds() -> list[int]:
    """This process's open file descriptors that are sockets (one per socket: a socket open on several fds counts
    once)."""
    seen: set[str] = set()
    fds = []
    base = "/proc/self/fd"
    for name in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:  # closed meanwhile (or listdir's own fd)
            continue
        if target.startswith("socket:[") and target not in seen:
            seen.add(target)
            fds.append(int(name))
    return fds


def own_tcp_sockets() -> list[TcpSocket]:
    """This process's TCP sockets (IPv4 and IPv6), asked of each socket itself: the cost is this process's own
    sockets, whatever the host's count."""
    found = []
    for fd in _socket_fds():
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile
            continue
        try:
            if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
                continue
            local = sock.getsockname()[1]
            listening = bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
            try:
                remote = sock.getpeername()[1]
            except OSError:  # listening, or not connected (yet, or any more)
                remote = 0
            found.append(TcpSocket(fd, local, remote, listening))
        except OSError:
            continue
        finally:
            sock.close()  # the duplicate only
    return found


def listening_ports() -> set[int]:
    """The ports this process listens on (TCP); none where ``/proc`` cannot tell (not Linux)."""
    try:
        return {s.local_port for s in own_tcp_sockets() if s.listening}
    except OSError:
        return set()


def mark_own_sockets(tos: int, match: Callable[[TcpSocket], bool]) -> int:
    """Set ``tos`` on each of this process's TCP sockets that ``match`` accepts and that does not carry it yet;
    returns how many were changed."""
    changed = 0
    for s in own_tcp_sockets():
        if not match(s):
            continue
        try:
            sock = socket.socket(fileno=os.dup(s.fd))
        except OSError:  # closed meanwhile
            continue
        try:
            if socket_tos(sock) != tos:
                set_socket_tos(sock, tos)
                changed += 1
        except OSError as e:  # closed meanwhile, or not an IP socket after all (the fd was reused)
            log.debug("cannot mark fd %d: %s", s.fd, e)
        finally:
            sock.close()  # the duplicate only: the socket stays open on its own fd
    return changed


class SocketMarker:
    """Marks the TCP sockets one traffic class of this process owns through a library: those on its own ports
    (``local_ports``: its listeners, and so every connection they accept) and those to its peers' ports
    (``add_remote_ports``). ``mark`` scans at most every ``interval_s`` unless forced: transports call it after
    connecting and after transfers, so a connection the library opened lazily is marked within one interval."""

    def __init__(self, tos: int, local_ports: Iterable[int] = (), interval_s: float = 1.0):
        self.tos, self.interval_s = tos, interval_s
        self.local_ports: frozenset[int] = frozenset(local_ports)
        self.remote_ports: frozenset[int] = frozenset()
        self.marked = 0  # sockets marked so far
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._failed = False

    def add_remote_ports(self, ports: Iterable[int]) -> None:
        with self._lock:
            self.remote_ports = self.remote_ports | frozenset(int(p) for p in ports)
            self._last = float("-inf")  # the next mark() scans

    def owns(self, s: TcpSocket) -> bool:
        return s.local_port in self.local_ports or (not s.listening and s.remote_port in self.remote_ports)

    def mark(self, force: bool = False) -> int:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return 0
        with self._lock:
            self._last = now
            try:
                n = mark_own_sockets(self.tos, self.owns)
            except OSError as e:  # /proc unreadable (not Linux): nothing is marked; said once
                if not self._failed:
                    log.warning("cannot mark sockets with TOS %d: %s", self.tos, e)
                self._failed = True
                return 0
            self.marked += n
            return n
