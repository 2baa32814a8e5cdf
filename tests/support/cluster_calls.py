"""Requests sent to a running cluster at once, with something done to the cluster meanwhile."""

from __future__ import annotations

import threading
import time
from typing import Callable


def generate_during(
    client,
    prompts: list[list[int]],
    params,
    action: Callable[[], None],
    after_s: float = 0.1,
    mode: str = "",
    join_s: float = 120.0,
) -> list:
    """Generate every prompt at once (a thread each); ``action()`` ``after_s`` seconds in. The results in prompt
    order; fails the test if a request hung or raised."""
    results: list = [None] * len(prompts)
    errors: list = []

    def one(i):
        try:
            results[i] = client.generate(prompts[i], params, mode=mode)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    time.sleep(after_s)
    action()
    for t in threads:
        t.join(join_s)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert not errors, errors
    return results
