"""bench/engine_floor.py: the device-interaction floor under the engine's per-token path."""

from __future__ import annotations

from bench.engine_floor import run


def test_both_loops_run_and_the_consumers_get_every_whole_group() -> None:
    steps, batch, group = 40, 4, 8
    out = run(steps=steps, batch=batch, group=group)
    assert set(out) == {"sync", "trio"}
    for f in out.values():
        assert f["us_per_token_process"] > 0 and f["us_per_step_wall"] > 0
        assert 0 < f["us_per_token_python_thread"] <= f["us_per_token_process"] * 1.01
    # every token reaches its lane's consumer, but for fewer than a group per lane at the end
    trio_ = out["trio"]
    assert trio_["tokens_delivered"] + trio_["tokens_left"] == steps * batch
    assert trio_["tokens_left"] < batch * group and trio_["tokens_delivered"] >= steps * batch - batch * group
