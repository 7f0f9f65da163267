import asyncio

import pytest

from cloud_server.idle_deadline import IdleDeadline


def test_fires_once_after_the_last_touch_not_the_first():
    async def go():
        fired = []
        d = IdleDeadline(0.15, lambda: fired.append(asyncio.get_running_loop().time()))
        t0 = d.last
        for _ in range(4):  # keep it alive past its first deadline
            await asyncio.sleep(0.06)
            d.touch()
        last = d.last
        assert not fired and not d.expired
        await asyncio.sleep(0.3)
        assert len(fired) == 1 and d.expired
        assert fired[0] - last >= 0.15 - 1e-3 and fired[0] - t0 > 0.3
        await asyncio.sleep(0.2)
        assert len(fired) == 1  # at most once

    asyncio.run(go())


def test_cancel_stops_it():
    async def go():
        fired = []
        d = IdleDeadline(0.05, lambda: fired.append(1))
        d.cancel()
        await asyncio.sleep(0.12)
        assert not fired and not d.expired

    asyncio.run(go())


def test_rejects_a_non_positive_idle_time():
    async def go():
        with pytest.raises(ValueError):
            IdleDeadline(0, lambda: None)

    asyncio.run(go())
