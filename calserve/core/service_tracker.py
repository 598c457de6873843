"""What the admitted (lane-holding) requests still need from the device, and how fast it serves.

The :class:`~calserve.core.admission.AdmissionController` feeds a :class:`ServiceTracker` from its own
calls (admit on pop, prefill/decode on ``charge``, ``release``) and the scheduler's tick
(``observe``); :func:`calserve.core.wait_estimate.expected_wait` reads it. Pure, clock passed in.
"""

from __future__ import annotations

from calserve.core.wait_estimate import ServiceModel

__all__ = ["ServiceTracker", "DECODE_RATIO_ALPHA", "OBSERVE_WINDOW_S", "OBSERVE_ALPHA"]

DECODE_RATIO_ALPHA = 0.05  # EWMA weight of one finished request in the observed decode ratio
OBSERVE_WINDOW_S = 0.05  # shortest saturated window sampled for the observed decode speed
OBSERVE_ALPHA = 0.2  # EWMA weight of one window (time constant ~0.25 s of saturation)


class ServiceTracker:
    """Per admitted request: decode length, prefill seconds still to run, decode tokens delivered.

    # Invariant: pending_prefill_s == sum of the prefill seconds of the requests in _unprefilled
    #   (reset to exactly 0 when nothing is admitted: no float residue).
    """

    def __init__(self, service: ServiceModel) -> None:
        self.service = service
        self._len: dict[int, float] = {}  # request id -> decode steps requested (max_new - 1)
        self._prefill: dict[int, float] = {}  # request id -> modeled prefill seconds
        self._decoded: dict[int, int] = {}  # request id -> decode tokens delivered
        self._unprefilled: set[int] = set()
        self.pending_prefill_s = 0.0
        # Observed delivered / requested decode tokens (early EOS, cancels), EWMA from 1.
        self.decode_ratio = 1.0
        # Observed seconds per decode lane-step while saturated; None until the first sample.
        self.lane_step_s: float | None = None
        self._decode_total = 0
        self._obs_at: float | None = None  # start of the current saturated observation window
        self._obs_tokens = 0

    def __len__(self) -> int:
        return len(self._len)

    @property
    def pending_prefill_n(self) -> int:
        return len(self._unprefilled)

    def admit(self, request_id: int, prompt_tokens: int, max_new_tokens: int) -> None:
        self._len[request_id] = float(max_new_tokens - 1)
        self._prefill[request_id] = p = self.service.prefill_s(prompt_tokens)
        self._decoded[request_id] = 0
        self._unprefilled.add(request_id)
        self.pending_prefill_s += p

    def served(self, request_id: int, prefill: bool, decode_tokens: int) -> None:
        """Service delivered to an admitted request (unknown ids only count toward the speed)."""
        self._decode_total += decode_tokens
        if request_id not in self._len:
            return
        if prefill and request_id in self._unprefilled:
            self._unprefilled.discard(request_id)
            self.pending_prefill_s -= self._prefill[request_id]
        self._decoded[request_id] += decode_tokens

    def served_decode(self, request_id: int) -> None:
        """``served(request_id, False, 1)``: one decode token (the per-token call)."""
        self._decode_total += 1
        d = self._decoded
        if request_id in d:
            d[request_id] += 1

    def release(self, request_id: int) -> None:
        want = self._len.pop(request_id, None)
        if want is None:
            return
        p = self._prefill.pop(request_id)
        if request_id in self._unprefilled:
            self._unprefilled.discard(request_id)
            self.pending_prefill_s -= p
        got = self._decoded.pop(request_id)
        if want > 0 and got > 0:  # prefill-only or never-served requests say nothing about lengths
            self.decode_ratio += DECODE_RATIO_ALPHA * (min(1.0, got / want) - self.decode_ratio)
        if not self._unprefilled:
            self.pending_prefill_s = 0.0

    def running_remaining(self) -> list[float]:
        """Decode steps left of each admitted request, scaled by the decode ratio, ascending."""
        r = self.decode_ratio
        return sorted(r * max(0.0, n - self._decoded[rid]) for rid, n in self._len.items())

    def observe(self, now: float, saturated: bool) -> None:
        """Sample the decode speed: seconds per decode lane-step over windows of at least
        ``OBSERVE_WINDOW_S`` that were ``saturated`` (a batch's worth admitted) at every call; an
        unsaturated call restarts the window, so a quiet period never makes a burst look slow."""
        if not saturated or self._obs_at is None or now < self._obs_at:
            self._obs_at = now if saturated else None
            self._obs_tokens = self._decode_total
            return
        dt = now - self._obs_at
        if dt < OBSERVE_WINDOW_S:
            return
        done = self._decode_total - self._obs_tokens
        if done > 0:
            sample = dt / done
            self.lane_step_s = sample if self.lane_step_s is None else (
                self.lane_step_s + OBSERVE_ALPHA * (sample - self.lane_step_s))
        self._obs_at, self._obs_tokens = now, self._decode_total
