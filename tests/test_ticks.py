"""Timers on the event loop's grid (hyperagent.ticks): periods that meet share a wake-up."""

from __future__ import annotations

import asyncio
import selectors

import pytest

from hyperagent import ticks


@pytest.mark.parametrize(
    ("now", "period", "expected"),
    [(10.0, 1.0, 11.0), (10.5, 1.0, 11.0), (10.999, 1.0, 11.0), (7.4, 2.5, 7.5), (0.0, 0.1, 0.1)],
)
def test_next_tick_is_the_next_multiple_after_now(
    now: float, period: float, expected: float
) -> None:
    assert ticks.next_tick(now, period) == pytest.approx(expected)
    assert ticks.next_tick(now, period) > now


def test_next_tick_is_always_after_now() -> None:
    for i in range(1, 20000):
        now = i * 0.1  # multiples of the period itself, as a grid timer's own start is
        assert ticks.next_tick(now, 0.1) > now


class CountingSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """Counts the selects that waited and returned with no file ready (timer wake-ups)."""

    timer_wakeups = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        events = super().select(timeout)
        if not events and timeout is not None and timeout > 0:
            CountingSelector.timer_wakeups += 1
        return events


def test_timers_whose_periods_meet_fire_in_one_wake_up() -> None:
    """A 0.1 s, a 0.2 s and a 0.3 s timer on the grid for 1.2 s: 0.1 s apart at most, they
    wake the loop 12 times or so, not 12 + 6 + 4."""
    woke: dict[float, list[float]] = {0.1: [], 0.2: [], 0.3: []}

    async def every(period: float) -> None:
        loop = asyncio.get_running_loop()
        while True:
            when = await ticks.sleep_to_tick(period)
            assert loop.time() >= when
            woke[period].append(when)

    async def main() -> None:
        tasks = [asyncio.create_task(every(p)) for p in woke]
        await asyncio.sleep(1.2)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    CountingSelector.timer_wakeups = 0
    loop = asyncio.SelectorEventLoop(CountingSelector())
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert len(woke[0.1]) >= 10 and len(woke[0.3]) >= 3
    for period in (0.2, 0.3):  # each tick is one of the 0.1 s grid's, to a nanosecond
        assert all(min(abs(t - u) for u in woke[0.1]) < 1e-9 for t in woke[period])
    assert CountingSelector.timer_wakeups <= 14


async def test_sleep_until_a_past_time_returns_at_once() -> None:
    loop = asyncio.get_running_loop()
    began = loop.time()
    await ticks.sleep_until(began - 5)
    assert loop.time() - began < 0.5
