"""Per-tick profile selection on the real software runtime (sim-next shared-KV group, real clock).

16 concurrent greedy requests of different lengths with profiles [1, 4, 8, 16]: each equals its
solo numpy reference although its decode steps ran on several member calbins (B1..B16) sharing
one KvManager; ``batches_total`` shows more than one B; nothing leaks (KV lanes, runtime
sequences, DRAM back to the post-load value, and to the pre-load value after shutdown).
"""

from __future__ import annotations

import trio

from calserve.config import decode_config
from calserve.engine.backend import RuntimeBackend
from calserve.engine.engine import Engine
from calserve.models.source import ModelSource
from calserve.runtime import Device
from calserve.runtime.reference import greedy_generate

from .helpers import greedy_concurrently


async def test_16_concurrent_over_a_shared_kv_group_equal_solo(demo_source: ModelSource) -> None:
    cfg = decode_config({"runtime": {"profile": "sim-next"},
                         "scheduler": {"batch": {"profiles": [1, 4, 8, 16]},
                                       "executor": {"max_inflight": 2}}})
    prompts = [tuple((11 * i + j * 7 + 3) % 500 + 3 for j in range(2 + (i * 3) % 13)) for i in range(16)]
    lengths = [6 + (i * 5) % 19 for i in range(16)]
    dev = Device.open(profile="sim-next", dram_bytes=1 << 30)
    try:
        be = RuntimeBackend(dev)
        base = dev.dram()[1]
        async with Engine.open(cfg, backend=be, sources={"qwen3": demo_source}) as eng:
            gen = eng.generation()
            assert sorted(gen.calbins) == [1, 4, 8, 16] and gen.calbin is gen.calbins[1]
            natives = [cb._c for cb in gen.calbins.values()]  # type: ignore[attr-defined]
            assert all(n.kv_owner is natives[0] for n in natives[1:])
            loaded = dev.dram()[1]
            out = await greedy_concurrently(eng, prompts, lengths)
            st = eng.statistics()
            assert len([b for b, n in st.batches_total.items() if n > 0]) >= 2, st.batches_total
            for b, n in st.batches_total.items():
                assert st.lanes_total[b] == b * n
            with trio.fail_after(5):  # the scheduler task frees the last sequences (device round trip)
                while gen.kv.statistics().free < gen.kv.statistics().num_lanes:
                    await trio.sleep(0.005)
            k = gen.kv.statistics()
            assert k.free == k.num_lanes and not gen.lane_seq
            assert natives[0].can_allocate(gen.spec.max_sequences)  # every runtime sequence freed
            assert dev.dram()[1] == loaded
        assert all(n.released for n in natives)
        assert dev.dram()[1] == base  # the group's weights + KV went with its last member
    finally:
        dev.close()
    for i in range(16):
        want = greedy_generate(demo_source.model_config, demo_source.weights, list(prompts[i]), lengths[i],
                               demo_source.profiles[1].kv_dtype)
        assert out[i] == want, f"request {i}"
