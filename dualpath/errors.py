"""Typed errors shared by every layer.

Each error names the thing that failed (a block hash, a tensor name, a field) so that a user reading a log
knows what to fix, and so that callers can answer a failure precisely (recompute a block, reject a request).
"""


class DualPathError(Exception):
    """Base class of every error the project raises on purpose."""


class CheckpointError(DualPathError):
    """A model checkpoint directory is unusable: unknown architecture, missing or misshapen tensors."""


class ConfigError(DualPathError):
    """A configuration value is invalid or inconsistent with another one."""


class RequestError(DualPathError):
    """A request is malformed or cannot be served (too long, bad sampling parameters)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class OutOfBlocksError(DualPathError):
    """A paged cache or buffer pool has no free block for an allocation."""
