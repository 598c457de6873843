"""calserve.engine.planner.fair_prefill_pick: the fair policy's next prompt of a prefill class,
with its one-tenant shortcut, against the rule written out (the least-served tenant's first live
prompt, ``fair_prefill_index`` over the live ones)."""

from __future__ import annotations

import collections
from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from calserve.core.prefill import fair_prefill_index
from calserve.engine.planner import fair_prefill_pick

_seq = st.builds(lambda tenant, ended, inflight: SimpleNamespace(
    req=SimpleNamespace(tenant=tenant), tenant=tenant, ended=ended,
    inflight=object() if inflight else None),
    st.sampled_from("abc"), st.booleans(), st.booleans())


def _rule(dq: collections.deque[Any], vt: dict[str, float]) -> int:
    live = [i for i, s in enumerate(dq) if not s.ended and s.inflight is None]
    return live[fair_prefill_index([dq[i].tenant for i in live], vt)]


@settings(max_examples=400, deadline=None)
@given(head_tenant=st.sampled_from("abc"), rest=st.lists(_seq, max_size=12),
       vt=st.dictionaries(st.sampled_from("abc"), st.floats(0, 10, allow_nan=False)))
def test_the_pick_is_the_least_served_tenants_first_live_prompt(
        head_tenant: str, rest: list[Any], vt: dict[str, float]) -> None:
    head = SimpleNamespace(req=SimpleNamespace(tenant=head_tenant), tenant=head_tenant,
                           ended=False, inflight=None)  # the caller's queue has a live head
    dq = collections.deque([head, *rest])
    assert fair_prefill_pick(dq, lambda t: vt.get(t, 0.0)) == _rule(dq, vt)


def test_one_tenant_takes_the_head_without_looking_at_the_others() -> None:
    class _Untouchable:
        req = SimpleNamespace(tenant="a")

        @property
        def ended(self) -> bool:
            raise AssertionError("the shortcut tests no queued prompt's state")

    head = SimpleNamespace(req=SimpleNamespace(tenant="a"), tenant="a", ended=False, inflight=None)
    assert fair_prefill_pick(collections.deque([head, _Untouchable(), _Untouchable()]),
                             lambda t: 0.0) == 0
