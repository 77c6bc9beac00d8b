"""Periodic timers on a grid of the event loop's clock.

A wake-up of an idle process costs more than most of the work it wakes for (about 0.15 ms of
CPU on a small VM, where the agent's cycle is about 5 ms). Timers that fire at multiples of
their period on the loop's clock, rather than a period after whenever they last ran, fire in
the same wake-up when their periods meet: the agent's collection at 1 s, the MQTT client's
once-a-second housekeeping, a report resend check.
"""

from __future__ import annotations

import asyncio
import math


def next_tick(now: float, period: float) -> float:
    """The first multiple of ``period`` after ``now``."""
    when = (math.floor(now / period) + 1) * period
    return when if when > now else when + period


async def sleep_until(when: float) -> None:
    """Sleep until the event loop's clock reads ``when`` (at once when it is past)."""
    loop = asyncio.get_running_loop()
    if when <= loop.time():
        await asyncio.sleep(0)
        return
    woken: asyncio.Future[None] = loop.create_future()
    timer = loop.call_at(when, _wake, woken)
    try:
        await woken
    finally:
        timer.cancel()


async def sleep_to_tick(period: float) -> float:
    """Sleep until the next multiple of ``period`` on the event loop's clock; returns it."""
    when = next_tick(asyncio.get_running_loop().time(), period)
    await sleep_until(when)
    return when


def _wake(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
