"""Storage read accounting for one node: what waits, what is in flight, what completed, and an optional cap.

The scheduler balances nodes by their read queue in tokens (the paper's read_q): bytes waiting or being read,
over the KV bytes of one token (all layers), so a layer-range read counts for its share of its tokens. The cap is
a token bucket on bytes per second, used to emulate each node's storage NIC when several "nodes" share one machine
in tests and benchmarks; it is off by default.

The accounting also keeps the intervals of its last ``READ_RATE_WINDOW_S`` seconds during which blocks waited for
an I/O thread (or for the cap), with the tokens whose reads finished in each, so the scheduler can measure how fast
the node reads while storage is the bottleneck (the paper's alpha, live) instead of trusting a start-up probe that
saw an idle disk. Only waiting counts: a read of a few blocks that never queues is latency, not bandwidth. While
blocks wait every I/O thread is busy, so the tokens finished over that time are the node's rate at full
concurrency (the last blocks of a burst finish after the waiting ends and are not counted, as its first blocks
started before it began: the two even out).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass

READ_RATE_WINDOW_S = 10.0  # the drain intervals reported: those of the last 10 s
_MERGE_GAP_S = 0.005  # waiting that stops and starts again within 5 ms stays one interval (a layer loop's reads)
_MAX_INTERVALS = 32  # beyond this the oldest goes (merged, the idle gaps between them would count as reading)


@dataclass(frozen=True)
class ReadSnapshot:
    queue_tokens: int  # tokens whose KV bytes are waiting or in flight
    waiting_bytes: int
    inflight_bytes: int
    completed_bytes: int
    completed_blocks: int


class ReadAccounting:
    def __init__(self, bandwidth_bps: float = 0.0, bytes_per_token: float = 1.0, clock=time.monotonic):
        self.bandwidth_bps = float(bandwidth_bps)
        self.clock = clock  # monotonic and system-wide: the intervals of one node's engines share a time base
        self.bytes_per_token = float(bytes_per_token)
        self._lock = threading.Lock()
        self._waiting_blocks = self._waiting_bytes = 0
        self._inflight_blocks = self._inflight_bytes = 0
        self._done_bytes = self._done_blocks = 0
        self._bucket = 0.0
        self._stamp = time.monotonic()
        # A 50 ms burst keeps the rate smooth without starving a single large block.
        self._burst = self.bandwidth_bps * 0.05
        # [start, end, tokens read] while blocks waited, oldest first; while some wait the last one is open (its
        # end is not yet known)
        self._intervals: deque[list[float]] = deque()

    def enqueue(self, num_blocks: int, nbytes: int) -> None:
        with self._lock:
            if num_blocks and not self._waiting_blocks:
                self._open_interval()
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
            if not self._waiting_blocks and self._intervals:  # (a read that was never enqueued has none)
                self._intervals[-1][1] = self.clock()
                if not self._intervals[-1][2]:  # no read finished while blocks waited: it measured nothing
                    self._intervals.pop()

    def finish(self, nbytes: int, ok: bool = True) -> None:
        with self._lock:
            self._inflight_blocks -= 1
            self._inflight_bytes -= nbytes
            if ok:
                self._done_bytes += nbytes
                self._done_blocks += 1
            if ok and self._waiting_blocks and self._intervals:
                self._intervals[-1][2] += nbytes / self.bytes_per_token

    def _open_interval(self) -> None:
        now = self.clock()
        if self._intervals and now - self._intervals[-1][1] <= _MERGE_GAP_S:
            return  # the last interval goes on
        self._intervals.append([now, now, 0.0])
        if len(self._intervals) > _MAX_INTERVALS:
            self._intervals.popleft()

    def drain_intervals(self, window_s: float = READ_RATE_WINDOW_S) -> list[list[float]]:
        """``[start, end, tokens]`` of each interval in the last ``window_s`` seconds during which blocks waited
        to be read (an open one ends now), and the tokens whose reads finished in it: storage read
        ``tokens / (end - start)`` while it was the bottleneck. Engines send these with every load report (the
        whole window each time, so a lost report loses nothing)."""
        with self._lock:
            now, waiting = self.clock(), self._waiting_blocks > 0
            while len(self._intervals) > waiting and self._intervals[0][1] < now - window_s:
                self._intervals.popleft()
            out = [list(i) for i in self._intervals]
            if out and waiting:
                out[-1][1] = now
            return out

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
            return ReadSnapshot(
                int(-(-pending // self.bytes_per_token)),
                self._waiting_bytes,
                self._inflight_bytes,
                self._done_bytes,
                self._done_blocks,
            )

    @property
    def queue_tokens(self) -> int:
        """Tokens waiting or being read: the load this node reports to the scheduler."""
        return self.snapshot().queue_tokens
