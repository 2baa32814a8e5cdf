"""Host-to-device copies of hit KV in the prefill layer loop, on their own CUDA stream.

The prefill engine's layer pipeline fetches layer l + 1 while layer l computes; on CUDA the fetch's last step, a
copy from pinned host buffers into a workspace slot, must not run on the compute stream (it would wait behind
the layer it should overlap) and must not make the host wait (the layer loop would stall). So copies go on a
copy stream, and events order the two streams: compute waits for a layer's copies, a copy into a slot waits for
the compute that last read that slot. The host never synchronizes inside the layer loop. On CPU, copies run
inline and the ordering calls do nothing.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch


class LayerCopies:
    """Callers: the prefill engine. ``issue`` may run in any thread (a transfer's completion callback);
    ``before_compute`` and ``after_compute`` run in the thread that launches compute, around each layer, and never
    block it; only the wait ``after_compute`` returns blocks, and it is called elsewhere (``LayerPipeline``'s
    sender thread)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()
        self._ready: dict[int, list] = {}  # layer -> events of its copies
        self._slot_free: dict[int, object] = {}  # workspace slot -> event after the last compute that read it

    def issue(self, layer: int, slot: int, copy: Callable[["torch.cuda.Stream | None"], None]) -> None:
        """Run ``copy(stream)`` (it issues async copies into ``slot`` on ``stream``) once ``slot`` is free."""
        if self.stream is None:
            copy(None)
            return
        with self._lock:
            free = self._slot_free.get(slot)
        with torch.cuda.stream(self.stream):
            if free is not None:
                self.stream.wait_event(free)
            copy(self.stream)
            done = torch.cuda.Event()
            done.record(self.stream)
        with self._lock:
            self._ready.setdefault(layer, []).append(done)

    def before_compute(self, layer: int) -> None:
        """The compute stream waits (on the device) for ``layer``'s copies."""
        if self.stream is None:
            return
        with self._lock:
            events = self._ready.pop(layer, [])
        compute = torch.cuda.current_stream(self.device)
        for e in events:
            compute.wait_event(e)

    def after_compute(self, slot: int) -> Callable[[], None]:
        """Everything launched so far on the compute stream is what reads ``slot``: later copies into it wait.
        Returns what blocks until that compute has finished (nothing to wait for on CPU): a transport reads the
        slot's device memory directly (a one-sided write to a peer), and only the host can tell it when, so the
        pipeline calls it from its sender thread, not from the thread launching compute."""
        if self.stream is None:
            return _nothing
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._slot_free[slot] = done
        return done.synchronize


def _nothing() -> None:
    """The wait for a CPU layer's compute: it finished before ``after_compute`` was called."""
