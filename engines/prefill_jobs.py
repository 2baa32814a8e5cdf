"""The one owner of a prefill engine's jobs: which it holds, which are ready to compute, which a step holds.

A job is always in exactly one of these states, and only this table moves it between them:

- *busy*: a step outside the table holds it (preparing: buffer slots, storage loads, the decode engine's
  reservation; or a running batch). The step gives it back with ``requeue`` or ends it with ``finish``.
- *ready*: waiting for a batch; ``take`` makes it busy again.

A cancel of a ready job removes it at once and hands it to the canceller to release. A cancel of a busy job is only
recorded: the step that holds it may still be writing into its buffer slots (a storage read landing, a layer's
KV being sent), so it releases the job when it gives it back, and ``requeue`` refuses to put it back on the ready
list. So a cancelled job never runs again, and its slots are released exactly once, by the last holder.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Callable, Generic, Iterable, Protocol, TypeVar


class HasWorkId(Protocol):
    @property
    def work_id(self) -> str: ...


J = TypeVar("J", bound=HasWorkId)


class PrefillJobs(Generic[J]):
    def __init__(self):
        self.cond = threading.Condition()  # also the engine's admission lock: ``held`` sees all work or none
        self._jobs: dict[str, J] = {}
        self._ready: deque[str] = deque()
        self._busy: set[str] = set()
        self._cancelled: set[str] = set()  # busy when cancelled: released by the step that holds them

    def admit(self, job: J, allowed: Callable[[], bool] = lambda: True) -> bool:
        """Hold ``job``, busy (its preparation runs next), if ``allowed()`` (checked under the lock)."""
        with self.cond:
            if not allowed() or job.work_id in self._jobs:
                return False
            self._jobs[job.work_id] = job
            self._busy.add(job.work_id)
            return True

    def requeue(self, job: J, front: bool = False) -> bool:
        """The step holding ``job`` gives it back to wait for a batch (``front``: ahead of the others, a chunked
        prompt's next chunk or a batch redone). False if it was cancelled meanwhile: it is dropped, and the caller
        releases what it holds."""
        with self.cond:
            if self._end(job.work_id):
                return False
            self._busy.discard(job.work_id)
            (self._ready.appendleft if front else self._ready.append)(job.work_id)
            self.cond.notify_all()
            return True

    def finish(self, job: J) -> bool:
        """The step holding ``job`` is done with it for good (handed off, or failed); whether it had been cancelled."""
        with self.cond:
            cancelled = self._end(job.work_id)
            if not cancelled and self._jobs.get(job.work_id) is job:
                self._drop(job.work_id)
            return cancelled

    def cancel(self, work_id: str) -> J | None:
        """Cancel ``work_id``: the job for the caller to release, or None (unknown, or busy: its step releases it)."""
        with self.cond:
            if work_id not in self._jobs or work_id in self._cancelled:
                return None
            if work_id in self._busy:
                self._cancelled.add(work_id)
                return None
            self._ready.remove(work_id)
            return self._drop(work_id)

    def cancelled(self, work_id: str) -> bool:
        with self.cond:
            return work_id in self._cancelled

    def take(
        self, choose: Callable[[list[J]], list[tuple[J, int]]], stop: threading.Event, wait_s: float = 0.1
    ) -> list[tuple[J, int]]:
        """Wait up to ``wait_s`` for ready jobs; ``choose`` (called under the lock with them, in arrival order) picks
        a batch of (job, tokens), which become busy."""
        with self.cond:
            self.cond.wait_for(lambda: self._ready or stop.is_set(), timeout=wait_s)
            if not self._ready:
                return []
            batch = choose([self._jobs[w] for w in self._ready])
            for job, _ in batch:
                self._ready.remove(job.work_id)
                self._busy.add(job.work_id)
            return batch

    def live(self) -> Iterable[J]:
        """The jobs held and not cancelled (a snapshot; for load reports)."""
        with self.cond:
            return [j for w, j in self._jobs.items() if w not in self._cancelled]

    def __contains__(self, work_id: str) -> bool:
        with self.cond:
            return work_id in self._jobs and work_id not in self._cancelled

    def _end(self, work_id: str) -> bool:
        """If ``work_id`` was cancelled while busy, forget it and return True."""
        if work_id not in self._cancelled:
            return False
        self._cancelled.discard(work_id)
        self._drop(work_id)
        return True

    def _drop(self, work_id: str) -> J:
        self._busy.discard(work_id)
        return self._jobs.pop(work_id)
