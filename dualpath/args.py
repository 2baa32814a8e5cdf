"""What the commands' options become: the model directory and the QoS classes (shared by ``dualpath.cli`` and
``dualpath.serving``, which the CLI imports: so they live below both)."""

from __future__ import annotations

import argparse


def resolve_model(arg: str | None) -> str:
    """The model directory a command was given, or the default model's (fetched on first use)."""
    if arg:
        return arg
    from dualpath.checkpoints.smollm2 import default_model_dir

    return str(default_model_dir())


def qos_config(args: argparse.Namespace):
    """``QosConfig`` from ``_qos_args``' options (``--kv-traffic-class`` names the KV DSCP as a byte)."""
    from dualpath.core.config import QosConfig
    from dualpath.core.errors import ConfigError

    kv_dscp = args.kv_dscp
    if args.kv_traffic_class is not None:
        tc = args.kv_traffic_class
        if not 0 <= tc <= 255 or tc & 3:
            raise ConfigError(f"--kv-traffic-class {tc}: a traffic class is DSCP << 2 (0..252, a multiple of 4)")
        if kv_dscp is not None and kv_dscp != tc >> 2:
            raise ConfigError(f"--kv-dscp {kv_dscp} and --kv-traffic-class {tc} (DSCP {tc >> 2}): give one")
        kv_dscp = tc >> 2
    return QosConfig(
        kv_service_level=args.kv_service_level,
        kv_dscp=QosConfig.kv_dscp if kv_dscp is None else kv_dscp,
        collective_service_level=args.collective_service_level,
        collective_dscp=args.collective_dscp,
    )
