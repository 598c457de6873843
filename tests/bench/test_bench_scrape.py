"""/metrics parsing and the derived batch-fill / queue-depth series."""

from __future__ import annotations

import pytest

from bench.scrape import derive_series, metric_value, parse_metrics


def _expo(active: float, lanes: float, waiting: int) -> str:
    return (
        "# TYPE calserve_batch_lanes_active counter\n"
        f'calserve_batch_lanes_active_total{{compiled_batch="16"}} {active}\n'
        f'calserve_batch_lanes_active_total{{compiled_batch="4"}} 0\n'
        "# TYPE calserve_batch_lanes counter\n"
        f'calserve_batch_lanes_total{{compiled_batch="16"}} {lanes}\n'
        "# TYPE calserve_requests_waiting gauge\n"
        f"calserve_requests_waiting {waiting}\n"
        "# TYPE calserve_request_ttft_seconds histogram\n"
        'calserve_request_ttft_seconds_bucket{le="0.1"} 3\n'
        "calserve_request_ttft_seconds_count 3\ncalserve_request_ttft_seconds_sum 0.2\n"
        "# TYPE other_metric gauge\nother_metric 5\n"
    )


def test_parse_and_derive() -> None:
    m = parse_metrics(_expo(10, 16, 2))
    assert "other_metric" not in m and not any(k.endswith("_bucket") for k in m)
    assert metric_value(m, "calserve_batch_lanes_active_total") == 10
    assert metric_value(m, "calserve_batch_lanes_active_total", compiled_batch="4") == 0
    assert metric_value(m, "calserve_nope") is None
    samples = [{"t": float(i), "values": parse_metrics(_expo(a, b, w))}
               for i, (a, b, w) in enumerate([(10, 16, 2), (26, 32, 5), (34, 48, 0), (34, 48, 0)])]
    s = derive_series(samples)
    # per-interval increments: 16/16, then 8/16; an interval with no batches gives no point
    assert s["batch_fill"] == [(1.0, 1.0), (2.0, 0.5)]
    assert [v for _, v in s["queue_depth"]] == [2, 5, 0, 0]


def test_bad_exposition_is_an_error() -> None:
    with pytest.raises(ValueError):
        parse_metrics("calserve_x{ 1\n")
