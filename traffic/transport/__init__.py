"""Transports by name: ``local``, ``shm``, ``ucx``, ``nixl``, ``verbs``."""

from __future__ import annotations

from dualpath.core.config import TransportConfig
from dualpath.core.errors import ConfigError
from dualpath.traffic.transport.base import Op, Priority, RegionDesc, Segment, TransferHandle, Transport

TRANSPORTS = ("local", "shm", "ucx", "nixl", "verbs")


def make_transport(config: TransportConfig, endpoint: str, **kwargs) -> Transport:
    """Build the transport named by ``config.name``; a backend whose library is missing raises ``ConfigError``
    naming what to install."""
    name = config.name
    if name == "local":
        from dualpath.traffic.transport.local import LocalTransport

        return LocalTransport(config, endpoint, **kwargs)
    if name == "shm":
        from dualpath.traffic.transport.shm import ShmTransport

        return ShmTransport(config, endpoint)
    if name == "ucx":
        from dualpath.traffic.transport.ucx import UcxTransport

        return UcxTransport(config, endpoint)
    if name == "nixl":
        from dualpath.traffic.transport.nixl import NixlTransport

        return NixlTransport(config, endpoint)
    if name == "verbs":
        from dualpath.traffic.transport.verbs import VerbsTransport

        return VerbsTransport(config, endpoint)
    raise ConfigError(f"unknown transport {name!r}; choose one of {TRANSPORTS}")


__all__ = ["Op", "Priority", "RegionDesc", "Segment", "TransferHandle", "Transport", "make_transport", "TRANSPORTS"]
