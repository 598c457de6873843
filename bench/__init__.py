"""calserve benchmarks: a lean load generator, reports, plots and named scenarios (issue 7).

Modules: ``loadgen`` (open/closed-loop load against any OpenAI-compatible server), ``httpclient`` (a
tiny HTTP/1.1 + SSE client on trio sockets), ``workload`` (lengths, tenants, arrival plans),
``summary`` (statistics over per-request records), ``scrape`` (``/metrics`` sampler), ``plots`` and
``report`` (PNG + markdown), ``server`` (start/stop a calserve subprocess), ``scenarios`` (one command
per named scenario), ``http_floor`` (per-token server CPU vs a bare ASGI app), ``floor_app`` (that
bare app; also the fake OpenAI server of the tests).
"""
