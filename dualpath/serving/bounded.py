"""Tokenizing and chat rendering, bounded and off the event loop.

A request's text is turned into token ids (prompts tokenized, chats rendered by their template then tokenized,
grammars compiled) on a small pool of worker threads (``off_loop``), never on the event loop that answers every
other request and ``/health``. Each piece is bounded:

* a text to tokenize, a prompt's or a rendered chat's, holds at most ``CHARS_PER_TOKEN`` characters per token of
  the model's context (a longer one could not fit unless its tokens averaged more than that; it is refused before
  it is tokenized, a 400 naming the field);
* rendering a chat template stops after ``--render-timeout`` seconds (``within``: a template is code, a request's
  own under ``--trust-request-chat-template``, and a loop in one could run for ever), a 400.

The time limit is checked between the Python lines the rendering runs (Jinja compiles templates to Python), so a
runaway template stops within one line's time; a single C call (tokenizing, one huge string operation) runs to its
end, which the size bound keeps short.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

CHARS_PER_TOKEN = 16  # the longest a text to tokenize may be, per token of the model's context
WORKER_THREADS = 4  # more would only wait for the interpreter's lock; a runaway template holds one for its timeout

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class RenderTimeout(Exception):
    """Rendering ran past its time limit (raised inside it, by ``within``)."""


async def off_loop(fn, *args):
    """``fn(*args)`` on the worker threads (its exceptions raised here)."""
    global _pool
    with _pool_lock:
        if _pool is None:  # one pool for every frontend of the process
            _pool = ThreadPoolExecutor(WORKER_THREADS, thread_name_prefix="tokenize")
    return await asyncio.get_running_loop().run_in_executor(_pool, functools.partial(fn, *args))


def within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on this thread, ended by ``RenderTimeout`` once ``seconds`` have passed: a trace
    function reads the clock at every Python line ``fn`` runs. Python unsets a trace function that raises, so the
    timeout is raised once; should ``fn`` swallow it, its late result is refused all the same."""
    deadline = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderTimeout(f"ran past {seconds:g} s")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.settrace(previous)
    if time.monotonic() > deadline:
        raise RenderTimeout(f"ran past {seconds:g} s")
    return out


class Recent:
    """What was made lately, by key: the ``size`` most recently used keys keep their value (grammars known to compile,
    request chat templates compiled), so what agents send again and again is made once. Shared by the worker
    threads: the lock guards the table, never the making (two threads may make one key at once; the last kept)."""

    def __init__(self, size: int):
        self.size = size
        self._lock = threading.Lock()
        self._table: OrderedDict = OrderedDict()

    def get(self, key, make):
        """``make()``'s value for ``key``, made again only once it left the ``size`` most recent keys (what ``make``
        raises is raised, nothing kept)."""
        with self._lock:
            if key in self._table:
                self._table.move_to_end(key)
                return self._table[key]
        value = make()
        with self._lock:
            self._table[key] = value
            if len(self._table) > self.size:
                self._table.popitem(last=False)
        return value
