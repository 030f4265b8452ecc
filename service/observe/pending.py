"""Events a hot path keeps to be counted later, many at once: the prediction and request
metrics (:mod:`service.observe.metrics`) and the served-class counts
(:mod:`service.observe.served`) of small answers."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Any


def drain_by_key(pending: deque) -> dict[Hashable, list[Any]]:
    """Pop every ``(key, item)`` waiting in ``pending`` and group the items by key, in
    order. Other threads may append meanwhile: a deque's appends and pops are atomic, so
    each item is drained once, here or by the next caller.

    >>> drain_by_key(deque([("a", 1), ("b", 2), ("a", 3)]))
    {'a': [1, 3], 'b': [2]}
    """
    groups: dict[Hashable, list[Any]] = {}
    while True:
        try:
            key, item = pending.popleft()
        except IndexError:
            return groups
        groups.setdefault(key, []).append(item)
