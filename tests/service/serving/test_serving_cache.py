"""ServingCache's lookups (service/serving/inference.py): requests that miss one key
together share one lookup; an invalidation in the meantime is not undone by it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from service.errors import NotFound
from service.serving.inference import ServingCache


class Lookups:
    """A stand-in for ``_resolve``: counts calls, and holds each until released."""

    def __init__(self, answer="served"):
        self.calls = 0
        self.answer = answer
        self.release = threading.Event()

    def __call__(self, *key):
        self.calls += 1
        number = self.calls
        assert self.release.wait(10)
        if isinstance(self.answer, Exception):
            raise self.answer
        return (self.answer, number)


def cache_with(lookups: Lookups, ttl: float = 60.0) -> ServingCache:
    cache = ServingCache(sessions=None, onnx=None, ttl=ttl)
    cache._resolve = lookups
    return cache


async def until(condition) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("condition never met")


def test_concurrent_misses_share_one_lookup():
    lookups = Lookups()
    cache = cache_with(lookups)

    async def main():
        waiters = [asyncio.ensure_future(cache.get("m", None, None, "ns")) for _ in range(8)]
        await until(lambda: lookups.calls == 1)
        await asyncio.sleep(0.05)
        lookups.release.set()
        answers = await asyncio.gather(*waiters)
        again = await cache.get("m", None, None, "ns")  # cached now
        return answers, again

    answers, again = asyncio.run(main())
    assert lookups.calls == 1
    assert answers == [("served", 1)] * 8 and again == ("served", 1)


def test_other_keys_are_looked_up_apart():
    lookups = Lookups()
    lookups.release.set()
    cache = cache_with(lookups)

    async def main():
        return await asyncio.gather(
            cache.get("m", None, None, "ns"), cache.get("m", "canary", None, "ns")
        )

    asyncio.run(main())
    assert lookups.calls == 2


def test_an_invalidation_during_a_lookup_is_not_undone():
    """A PUT of an alias in this process applies at once: a request after it looks up
    again, and what the older lookup found is not kept."""
    lookups = Lookups()
    cache = cache_with(lookups)

    async def main():
        first = asyncio.ensure_future(cache.get("m", None, None, "ns"))
        await until(lambda: lookups.calls == 1)
        cache.invalidate("m", "ns")
        second = asyncio.ensure_future(cache.get("m", None, None, "ns"))
        await until(lambda: lookups.calls == 2)
        lookups.release.set()
        return await first, await second, await cache.get("m", None, None, "ns")

    first, second, third = asyncio.run(main())
    assert (first, second) == (("served", 1), ("served", 2))
    assert third == ("served", 2) and lookups.calls == 2


def test_what_a_lookup_found_before_an_invalidation_is_not_kept():
    lookups = Lookups()
    cache = cache_with(lookups)

    async def main():
        first = asyncio.ensure_future(cache.get("m", None, None, "ns"))
        await until(lambda: lookups.calls == 1)
        cache.invalidate("m", "ns")
        lookups.release.set()
        await first
        return await cache.get("m", None, None, "ns")

    assert asyncio.run(main()) == ("served", 2)


def test_a_failed_lookup_reaches_every_waiter_and_is_not_kept():
    lookups = Lookups(NotFound("no such model"))
    cache = cache_with(lookups)

    async def main():
        waiters = [asyncio.ensure_future(cache.get("m", None, None, "ns")) for _ in range(3)]
        await until(lambda: lookups.calls == 1)
        lookups.release.set()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        with pytest.raises(NotFound):
            await cache.get("m", None, None, "ns")
        return results

    results = asyncio.run(main())
    assert all(isinstance(r, NotFound) for r in results)
    assert lookups.calls == 2  # the failure was not cached


def test_a_cancelled_waiter_leaves_the_lookup_to_the_others():
    lookups = Lookups()
    cache = cache_with(lookups)

    async def main():
        first = asyncio.ensure_future(cache.get("m", None, None, "ns"))
        second = asyncio.ensure_future(cache.get("m", None, None, "ns"))
        await until(lambda: lookups.calls == 1)
        first.cancel()
        await asyncio.sleep(0.01)
        lookups.release.set()
        return await second

    assert asyncio.run(main()) == ("served", 1)
    assert lookups.calls == 1
