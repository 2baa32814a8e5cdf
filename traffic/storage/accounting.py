"""Storage read accounting for one node: what waits, what is in flight, what completed, and an optional cap.

The scheduler balances nodes by their read queue in tokens (the paper's read_q): bytes waiting or being read,
over the KV bytes of one token (all layers), so a layer-range read counts for its share of its tokens. The cap is a token bucket on bytes per second, used to emulate each node's storage NIC
when several "nodes" share one machine in tests and benchmarks; it is off by default.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ReadSnapshot:
    queue_tokens: int  # tokens whose KV bytes are waiting or in flight
    waiting_bytes: int
    inflight_bytes: int
    completed_bytes: int
    completed_blocks: int


class ReadAccounting:
    def __init__(self, bandwidth_bps: float = 0.0, bytes_per_token: float = 1.0):
        self.bandwidth_bps = float(bandwidth_bps)
        self.bytes_per_token = float(bytes_per_token)
        self._lock = threading.Lock()
        self._waiting_blocks = self._waiting_bytes = 0
        self._inflight_blocks = self._inflight_bytes = 0
        self._done_bytes = self._done_blocks = 0
        self._bucket = 0.0
        self._stamp = time.monotonic()
        # A 50 ms burst keeps the rate smooth without starving a single large block.
        self._burst = self.bandwidth_bps * 0.05

    def enqueue(self, num_blocks: int, nbytes: int) -> None:
        with self._lock:
            self._waiting_blocks += num_blocks
            self._waiting_bytes += nbytes

    def start(self, nbytes: int) -> None:
        """One block goes from waiting to in flight, after waiting for the bandwidth cap if there is one."""
        self._throttle(nbytes)
        with self._lock:
            self._waiting_blocks -= 1
            self._waiting_bytes -= nbytes
            self._inflight_blocks += 1
            self._inflight_bytes += nbytes

    def finish(self, nbytes: int, ok: bool = True) -> None:
        with self._lock:
            self._inflight_blocks -= 1
            self._inflight_bytes -= nbytes
            if ok:
                self._done_bytes += nbytes
                self._done_blocks += 1

    def _throttle(self, nbytes: int) -> None:
        if self.bandwidth_bps <= 0:
            return
        with self._lock:
            now = time.monotonic()
            self._bucket = min(self._burst, self._bucket + (now - self._stamp) * self.bandwidth_bps)
            self._stamp = now
            self._bucket -= nbytes  # may go negative: the debt is paid by waiting
            wait = -self._bucket / self.bandwidth_bps if self._bucket < 0 else 0.0
        if wait > 0:
            time.sleep(wait)

    def snapshot(self) -> ReadSnapshot:
        with self._lock:
            pending = self._waiting_bytes + self._inflight_bytes
            return ReadSnapshot(int(-(-pending // self.bytes_per_token)), self._waiting_bytes, self._inflight_bytes,
                                self._done_bytes, self._done_blocks)

    @property
    def queue_tokens(self) -> int:
        """Tokens waiting or being read: the load this node reports to the scheduler."""
        return self.snapshot().queue_tokens
