"""Board selection (``runtime.device``): each index opens its own simulated board."""

from __future__ import annotations

from typing import Any

import pytest

from calserve.config import FaultsConfig
from calserve.engine import backend as backend_mod
from calserve.runtime import Device, InvalidArgument


def test_board_index_is_opened_and_reported() -> None:
    with Device.open("calrt-0.7.6", dram_bytes=1 << 30, device=3) as d:
        assert d.device == 3 and d.serial == "calrt-sim-board-3"
    with Device.open("sim-next", dram_bytes=1 << 30) as d:
        assert d.device == 0 and d.serial == "calrt-sim-board-0"


@pytest.mark.parametrize("index", [16, 1000])
def test_missing_board_is_refused_naming_it(index: int) -> None:
    with pytest.raises(InvalidArgument, match=f"board {index} does not exist"):
        Device.open("calrt-0.7.6", dram_bytes=1 << 30, device=index)
    Device.open("calrt-0.7.6", dram_bytes=1 << 30).close()  # nothing was left open


def test_negative_board_refused() -> None:
    with pytest.raises(InvalidArgument, match="device"):
        Device.open(device=-1)


async def test_each_board_draws_its_own_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    seeds: list[int] = []

    class Recording(backend_mod.FaultPlan):
        def __init__(self, rate: float, kinds: Any, seed: int, inject: Any) -> None:
            seeds.append(seed)
            super().__init__(rate, kinds, seed, inject)

    monkeypatch.setattr(backend_mod, "FaultPlan", Recording)
    faults = FaultsConfig(rate=0.1, seed=5)
    for index in (0, 1, 2):
        b = await backend_mod.RuntimeBackend.open("calrt-0.7.6", 1 << 30, faults=faults,
                                                  gc_gen0=0, device=index)
        await b.aclose()
    assert seeds[0] == 5 and len(set(seeds)) == 3
