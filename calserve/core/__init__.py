"""Pure scheduling decisions: no trio, no I/O, no clock reads (every decision takes ``now``).

Modules (one job each):

- :mod:`.fsm` — transition-table helper, :class:`IllegalTransition`
- :mod:`.request_state`, :mod:`.kv_state`, :mod:`.model_state` — the three lifecycles (spec §2, §9.1, §10)
- :mod:`.admission` — budgets, outcomes, per-tenant weighted fair queue (spec §5); its parts:
  :mod:`.admission_types` (plain data), :mod:`.admission_checks` (limits and quotas),
  :mod:`.admission_tenants` (per-tenant state, token buckets), :mod:`.admission_queue` (the fair queue)
- :mod:`.wait_estimate`, :mod:`.service_tracker` — a new request's expected queue wait and the
  running-sequence cap (overload admission, spec §5.2)
- :mod:`.prefill` — size classes and the decode/short/medium/long round robin (spec §6)
- :mod:`.decode` — decode batch building, profile selection, batching window (spec §7–§8)
- :mod:`.kv` — KV lane manager with the §9.2 invariants (spec §9)
"""
