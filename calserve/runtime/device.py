"""The typed, synchronous facade over the CalRT binding ``calserve._calrt`` (no trio here).

Why a facade: the binding is kept tiny (handles, buffers, status codes); this module owns the Python
shapes (``ModelConfig``, ``ProfileSpec``, enums, :class:`JobResult`), and every call goes through
:func:`calserve.runtime.binding.call`, which maps CalRT status codes onto the
:class:`~calserve.runtime.types.CalrtError` tree, so the engine never sees a raw code.

Contract in brief (the full C-level contract is documented in ``ext/calrt/include/calrt.h``):

* One :class:`Device` per process (``Device.open`` twice -> :class:`DeviceAlreadyOpen` until ``close``).
* ``sim-next`` has two chips (``chip=0/1``), each with its own DRAM, PING/PONG engines, queues and reset
  domain; ``calrt-0.7.6`` has one chip.
* Each engine has a queue of depth :data:`QUEUE_DEPTH` (= 2: one job running + one waiting). A submit
  beyond that raises :class:`DeviceBusy` (and counts in ``EngineCounters.busy``).
* Submitting on a faulted chip (after ``CCU_FAULT`` / ``DMA_UNKNOWN``, until ``reset``) raises
  :class:`DeviceFaulted`; on a calbin that needs a reconfigure (after ``DMA_UNKNOWN`` + reset) too.
* A job's KV length commit (``committed_len += tokens``) happens on the device only when its status is
  ``OK``. ``INVALID`` (position != committed_len at execution, sequence invalidated, sequence already
  used by a running job) writes nothing.
* ``reset`` aborts every in-flight job of the chip (each completes ``ABORTED``; ``Job.wait`` returns it)
  and invalidates every KV sequence of the chip (``sequence_valid`` -> False; the ids stay allocated
  until ``free_sequence``). Weights stay configured except after ``DMA_UNKNOWN``.
* Every output lane echoes ``(job_id, seq_id, position)`` and a 64-bit checksum (``calrt_checksum``) of its logits row
  bytes; :func:`logits_checksum` / :func:`corrupted_lanes` let the caller detect crosstalk.
* Shared KV (C3, ``capabilities.shared_kv``, sim-next only): ``load_calbin(..., kv_owner=cb)`` makes the
  new calbin (e.g. the B16 profile) a member of ``cb``'s KV group (e.g. the B1 profile of the same
  model): one KvManager, one set of sequences and one weights + KV DRAM charge for the whole group, so a
  sequence can be decoded at B1 and at B16 alternately (spec §8). Members are released in any order;
  the group's KV lives until the last one is released. ``calrt-0.7.6``: :class:`NotSupported`.
* Prompt logits (C3-style, ``capabilities.prompt_logits``, sim-next only; not described as supported by
  hardware): ``submit_prefill(..., all_logits=True)`` returns the logits of every prompt position
  (``[len(tokens), vocab]``, one lane per token), so a host scores a whole prompt in one job instead of
  one decode step per prompt token. ``calrt-0.7.6`` (or a runtime build without it): :class:`NotSupported`.
* Multi-step decode (C3-style, ``capabilities.multi_step``, sim-next only; not described as supported by
  hardware): ``submit_decode(..., steps=N)`` runs N greedy steps in one job, each lane's argmax fed back
  on the device; the result's ``step_tokens`` are the N tokens of each lane (bitwise those of N
  single-step jobs). ``calrt-0.7.6`` (or a runtime build without it): :class:`NotSupported`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from calserve.runtime.binding import binding, call, corrupted_lanes, logits_checksum
from calserve.runtime.job import Job
from calserve.runtime.reference import GEMMA2, GEMMA3, LLAMA, QWEN2, QWEN3, ModelConfig, weight_shapes
from calserve.runtime.types import (
    RUNTIME_PROFILES,
    CalrtError,
    EngineCounters,
    FaultKind,
    InvalidArgument,
    JobEngine,
    NotSupported,
    ProfileSpec,
    RuntimeCapabilities,
    Timing,
)

__all__ = ["Device", "Calbin", "Job", "QUEUE_DEPTH", "logits_checksum", "corrupted_lanes"]

#: Jobs an engine holds at once (running + waiting). A further submit raises DeviceBusy.
QUEUE_DEPTH = 2
# calrt.h's calrt_arch of each decoder family
_ARCH_CODES = {QWEN3: 0, LLAMA: 1, QWEN2: 2, GEMMA3: 3, GEMMA2: 4}


def _i32(name: str, values: Sequence[int] | np.ndarray, n: int | None = None) -> np.ndarray:
    if type(values) is np.ndarray and values.dtype == np.int32 and values.ndim == 1 and values.flags.c_contiguous:
        # Hot path (the engine passes int32 rows): already in range by type, no copy (~30 us/submit).
        if n is not None and values.shape[0] != n:
            raise InvalidArgument(f"{name}: expected {n} entries (compiled_batch), got {values.shape[0]}", 1)
        return values
    a = np.ascontiguousarray(values, dtype=np.int64).reshape(-1)
    if n is not None and a.shape[0] != n:
        raise InvalidArgument(f"{name}: expected {n} entries (compiled_batch), got {a.shape[0]}", 1)
    if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
        raise InvalidArgument(f"{name}: values out of int32 range", 1)
    return a.astype(np.int32)


class Calbin:
    """A created + configured calbin (one compiled batch profile) and its KvManager.

    Sequence ids are small ints in ``[0, spec.max_sequences)``. All methods are thread-safe.
    """

    def __init__(
        self,
        device: Device,
        handle: Any,
        config: ModelConfig,
        spec: ProfileSpec,
        chip: int,
        kv_owner: Calbin | None = None,
    ) -> None:
        self._device = device
        self._h = handle
        self.config = config
        self.spec = spec
        self.chip = chip
        self.calbin_id: int = int(handle.calbin_id)
        #: The calbin passed as ``kv_owner`` at load (None for a standalone calbin / group creator).
        self.kv_owner: Calbin | None = kv_owner
        # Invariant: a loaded calbin stays in the same KV group until release (the facade never
        # resets a configuration without destroying the calbin), so the id can be cached.
        self.kv_group: int = int(handle.introspect()["kv_group"])
        self._released = False

    def kv_group_members(self) -> list[Calbin]:
        """Live calbins of this device sharing this calbin's KvManager (itself included), in load
        order. A standalone calbin is a group of one. Empty once released."""
        if self._released:
            return []
        return [cb for cb in self._device.calbins() if cb.kv_group == self.kv_group]

    @property
    def released(self) -> bool:
        return self._released

    # ---- lifecycle ---------------------------------------------------------------------------
    def introspect(self) -> dict[str, Any]:
        """What the device reports about this configured calbin (spec §11 step 8).

        Keys: ``calbin_id``, ``chip``, ``model`` (ModelConfig dict), ``tensors`` (list of
        ``(name, shape, dtype)``), ``compiled_batch``, ``max_seq``, ``max_sequences``, ``kv_dtype``,
        ``kv_layout`` (dict: ``order``, ``shape_per_sequence``, ``dtype``, ``bytes_per_token``),
        ``valid_mask``, ``inactive_logits``, ``inactive_writes_kv``, ``exact_submodel``,
        ``dram_bytes`` (charged), ``configured``.
        """
        return dict(call(self._h.introspect))

    def reconfigure(self) -> None:
        """Configure again after a ``DMA_UNKNOWN`` fault + reset (weights re-uploaded)."""
        call(self._h.reconfigure)

    @property
    def needs_reconfigure(self) -> bool:
        return bool(self._h.needs_reconfigure())

    def release(self) -> None:
        """ResetConfiguration + destroy: frees the DRAM. :class:`InvalidArgument` while jobs are in
        flight on it (wait for them or reset the chip first). Idempotent."""
        call(self._h.release)
        self._released = True
        self._device._forget(self)

    # ---- KvManager ---------------------------------------------------------------------------
    def can_allocate(self, n: int) -> bool:
        """Whether ``n`` more sequences can be created now."""
        return bool(call(self._h.can_allocate, int(n)))

    def create_sequence(self) -> int:
        """A new empty sequence (committed_len 0). :class:`OutOfSequences` if all are taken."""
        return int(call(self._h.create_sequence))

    def free_sequence(self, seq_id: int) -> None:
        """Free a sequence (valid or invalidated). :class:`InvalidArgument` if a job in flight uses
        it or it is not allocated."""
        call(self._h.free_sequence, int(seq_id))

    def committed_len(self, seq_id: int) -> int:
        """Tokens committed in the sequence's KV. :class:`InvalidArgument` if invalidated/unknown."""
        return int(call(self._h.committed_len, int(seq_id)))

    def sequence_valid(self, seq_id: int) -> bool:
        """False once a reset invalidated it or a CCU fault left its KV unknown."""
        return bool(call(self._h.sequence_valid, int(seq_id)))

    def remove_tokens_at_end(self, seq_id: int, n: int) -> None:
        """Drop the last ``n`` committed tokens (RemoveTokensAtEnd)."""
        call(self._h.remove_tokens_at_end, int(seq_id), int(n))

    def do_shift(self, seq_id: int, n: int) -> None:
        """DoShift (C1): drop the first ``n`` tokens' KV, keeping positions of the rest as stored
        (the cached K keep their RoPE phases; the caller continues at ``committed_len``)."""
        call(self._h.do_shift, int(seq_id), int(n))

    def copy_prefix(self, src_seq: int, dst_seq: int, n: int) -> None:
        """Not supported by CalRT 0.7.6 (spec §9.3): always :class:`NotSupported`."""
        call(self._h.unsupported, "copy_prefix")

    def keep_one(self, seq_id: int) -> None:
        """Not supported (spec §9.3): always :class:`NotSupported`."""
        call(self._h.unsupported, "keep_one")

    def position_add(self, seq_id: int, delta: int) -> None:
        """Not supported (spec §9.3): always :class:`NotSupported`."""
        call(self._h.unsupported, "position_add")

    def position_div(self, seq_id: int, divisor: int) -> None:
        """Not supported (spec §9.3): always :class:`NotSupported`."""
        call(self._h.unsupported, "position_div")

    def save_session(self, seq_id: int) -> bytes:
        """Not supported (spec §9.3): always :class:`NotSupported`."""
        call(self._h.unsupported, "save_session")
        raise AssertionError("unreachable")

    def load_session(self, seq_id: int, blob: bytes) -> None:
        """Not supported (spec §9.3): always :class:`NotSupported`."""
        call(self._h.unsupported, "load_session")

    def read_kv(self, seq_id: int) -> np.ndarray:
        """Sim-only debug readback: the sequence's raw KV storage (all ``max_seq`` slots).

        Shape ``[layers, 2 (K,V), kv_heads, max_seq, head_dim]``, dtype float32 (fp32 KV) or uint16
        (bf16 KV bits). :class:`NotSupported` on a vendor build or with ``null_compute``.
        """
        return np.asarray(call(self._h.read_kv, int(seq_id)))

    # ---- jobs --------------------------------------------------------------------------------
    def submit_prefill(
        self,
        seq_id: int,
        tokens: Sequence[int] | np.ndarray,
        engine: JobEngine = JobEngine.PING,
        all_logits: bool = False,
    ) -> Job:
        """Submit the whole prompt ``tokens`` of ``seq_id``, appended at its committed_len.

        The result's logits are ``[1, vocab]`` for the last position; echo ``(job_id, seq_id,
        committed_len + len(tokens) - 1)``. Raises :class:`DeviceBusy` (queue full),
        :class:`DeviceFaulted` (reset/reconfigure needed), :class:`InvalidArgument` (empty, token out
        of range, longer than max_seq).

        ``all_logits`` (prompt logits, C3-style: ``capabilities.prompt_logits``, sim-next only): the
        logits of every prompt position instead, ``[len(tokens), vocab]``, row ``i`` those after
        ``tokens[:i + 1]`` (row ``-1`` is the ordinary result's row), echo row ``i`` ``(job_id, seq_id,
        committed_len + i)`` and checksum ``i`` of row ``i``: verify with
        ``verify_lanes(result, job_id, range(n), [(seq_id, committed_len + i) for i in range(n)])``.
        Everything else as without it (the same checks, all tokens committed only when the job
        completes OK, faults, timing). In calrt-sim row ``i`` is bitwise the row of an ordinary prefill
        of ``tokens[:i + 1]`` at the same committed_len. Costs ``len(tokens) * vocab`` float32 of host
        memory for the output. Without the capability: :class:`NotSupported`.
        """
        toks = _i32("tokens", tokens)
        if all_logits:
            if not self._device.capabilities.prompt_logits:
                raise NotSupported(f"all_logits: prompt logits (every position's logits from a prefill, C3) "
                                   f"are not supported by runtime profile {self._device.profile}", 2)
            h = call(self._h.submit_prefill_all, int(seq_id), toks, int(engine))
        else:
            h = call(self._h.submit_prefill, int(seq_id), toks, int(engine))
        return Job(h, engine, self.chip)

    def submit_decode(
        self,
        seq_ids: Sequence[int] | np.ndarray,
        tokens: Sequence[int] | np.ndarray,
        positions: Sequence[int] | np.ndarray,
        valid: Sequence[bool] | np.ndarray,
        engine: JobEngine = JobEngine.PING,
        steps: int = 1,
        lane_steps: Sequence[int] | np.ndarray | None = None,
        host: bool = False,
        ends: tuple[np.ndarray, np.ndarray, np.ndarray | None] | None = None,
    ) -> Job:
        """Submit one decode step over the compiled batch (all arrays of length ``compiled_batch``).

        For a valid lane, ``positions[i]`` must equal the sequence's committed_len at execution, else
        the job completes ``INVALID`` and writes nothing. Invalid lanes never write KV; their logits
        rows are zeros, echo ``(job_id, -1, -1)``, checksum 0. Valid lanes must name distinct
        sequences. Logits ``[compiled_batch, vocab]``.

        ``steps`` > 1 (C3-style, ``capabilities.multi_step``, sim-next only): ``steps`` greedy steps
        in one job, each lane's argmax fed back as its next input (``positions[i] + steps <=
        max_seq``); ``committed_len`` grows by ``steps``; the result's ``step_tokens`` holds the
        tokens ``[compiled_batch, steps]``, its logits, echo and checksums the last step's.
        ``lane_steps`` (None: every lane ``steps``): lane ``i`` runs only ``lane_steps[i]`` in ``[1,
        steps]`` of them (its own last step's logits, echo and checksum; zeros in ``step_tokens``
        after its steps; ``committed_len`` grows by its steps).

        ``host`` (with ``steps`` > 1; any runtime, calrt-0.7.6 included): the same job driven by the
        host instead of the device (``ext/host_steps.h``): ``steps`` one-step device jobs back to
        back on ``engine``, each lane's argmax fed back by the binding in C while ``wait`` runs (and
        by ``done``, never blocking), with no Python between the steps. The same result: each
        lane's last step's logits, echo and checksum (the echo naming this job's id), the tokens
        ``[compiled_batch, steps]``. Each step's output is checked before its tokens are fed back;
        a step that fails the check or does not complete OK ends the job there (``host_steps.h``).
        ``ends`` (host runs only): ``(end_off, end_ids, end_from)``, each lane's end tokens
        ``end_ids[end_off[i]:end_off[i + 1]]`` (``end_off``: ``compiled_batch + 1`` offsets from 0)
        counted from its step ``end_from[i]`` on (None: from its first): a lane whose argmax is
        one of them ends with that step (its steps, KV and outputs those of that many steps), and
        the job ends once no lane runs (``step_tokens`` then ``[compiled_batch, steps run]``). The
        result's ``lane_steps`` then gives each lane's steps run (None when every lane ran all of
        its own).
        """
        b = self.spec.compiled_batch
        s = _i32("seq_ids", seq_ids, b)
        t = _i32("tokens", tokens, b)
        p = _i32("positions", positions, b)
        v = np.ascontiguousarray(valid, dtype=np.uint8).reshape(-1)
        if v.shape[0] != b:
            raise InvalidArgument(f"valid: expected {b} entries (compiled_batch), got {v.shape[0]}", 1)
        if steps == 1:
            return Job(call(self._h.submit_decode, s, t, p, v, int(engine)), engine, self.chip)
        if not host and not self._device.capabilities.multi_step:
            raise NotSupported("steps: multi-step decode needs the runtime capability multi_step "
                               "(C3-style, sim-next only)", 2)
        ls = None if lane_steps is None else _i32("lane_steps", lane_steps, b)
        if not host:
            if ends is not None:
                raise NotSupported("ends: only a host-driven multi-step decode (host=True) ends lanes on "
                                   "their tokens", 2)
            return Job(call(self._h.submit_decode, s, t, p, v, int(engine), int(steps), ls), engine, self.chip,
                       int(steps))
        if ends is None:
            h = call(self._h.submit_decode_host, s, t, p, v, int(engine), int(steps), ls)
        else:
            off, ids, frm = ends
            h = call(self._h.submit_decode_host, s, t, p, v, int(engine), int(steps), ls,
                     _i32("end_off", off, b + 1), _i32("end_ids", ids, None),
                     None if frm is None else _i32("end_from", frm, b))
        return Job(h, engine, self.chip, int(steps), host=True)

    def __repr__(self) -> str:
        return f"Calbin(id={self.calbin_id}, chip={self.chip}, B={self.spec.compiled_batch})"


class Device:
    """The process's one VirtualDevice (calrt-sim or a vendor CalRT, chosen at build time)."""

    _lock = threading.Lock()

    def __init__(self, handle: Any, profile: str, null_compute: bool) -> None:
        self._h = handle
        self.profile = profile
        self.null_compute = null_compute
        caps = dict(handle.capabilities())
        known = RUNTIME_PROFILES.get(profile)
        self.capabilities: RuntimeCapabilities = known or RuntimeCapabilities(
            name=profile,
            batch_profiles=bool(caps["batch_profiles"]),
            multi_calbin=bool(caps["multi_calbin"]),
            chip_scoped=bool(caps["chip_scoped"]),
            pingpong=bool(caps["pingpong"]),
            do_shift=bool(caps["do_shift"]),
        )
        # Properties of the build too: a runtime without calrt_calbin_share_kv lacks shared_kv, one
        # without calrt_job_create_prefill_all lacks prompt_logits, whatever its profile says.
        built: dict[str, Any] = {name: bool(caps.get(name, False))
                                 for name in ("shared_kv", "prompt_logits", "multi_step")}
        if any(getattr(self.capabilities, k) != v for k, v in built.items()):
            self.capabilities = dataclasses.replace(self.capabilities, **built)
        self.chips: int = int(caps["chips"])
        # The board this process opened (runtime.device) and its identity as the runtime reports it.
        self.device: int = int(caps.get("device", 0))
        self.serial: str = str(caps.get("serial", ""))
        self.queue_depth: int = int(caps["queue_depth"])
        self.sim_debug: bool = bool(caps["sim_debug"])
        self._calbins: list[Calbin] = []

    @classmethod
    def open(
        cls,
        profile: str = "calrt-0.7.6",
        dram_bytes: int = 32 << 30,
        null_compute: bool = False,
        completion_jitter_us: int = 0,
        seed: int = 0,
        device: int = 0,
    ) -> Device:
        """Open the VirtualDevice on board ``device`` (one board per process). ``dram_bytes`` is
        per chip.

        :class:`DeviceAlreadyOpen` if one is open in this process; :class:`InvalidArgument` for an
        unknown profile or a board index the runtime does not have. ``completion_jitter_us`` adds a seeded random delay in ``[0, jitter]`` to each
        completion (shuffles completion order across engines, spec §17.3).
        """
        if profile not in RUNTIME_PROFILES:
            raise InvalidArgument(
                f"profile: unknown runtime profile {profile!r} (known: {sorted(RUNTIME_PROFILES)})", 1
            )
        if dram_bytes <= 0:
            raise InvalidArgument("dram_bytes must be > 0", 1)
        if completion_jitter_us < 0:
            raise InvalidArgument("completion_jitter_us must be >= 0", 1)
        if not 0 <= device < 2**31:
            raise InvalidArgument(f"device: board index must be >= 0 (got {device})", 1)
        b = binding()
        h = call(b.Device, profile, int(dram_bytes), bool(null_compute), int(completion_jitter_us),
                  int(seed) & 0xFFFFFFFFFFFFFFFF, int(device))
        return cls(h, profile, bool(null_compute))

    def close(self) -> None:
        """Reset every chip (aborting in-flight jobs), release every calbin, close. Idempotent."""
        if self._calbins:
            try:
                call(self._h.reset, -1)
            except CalrtError:
                pass
        for cb in list(self._calbins):
            try:
                cb.release()
            except CalrtError:
                pass
        self._calbins.clear()
        self._h.close()

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def dram(self, chip: int = 0) -> tuple[int, int]:
        """(capacity, used) bytes of a chip's DRAM."""
        cap, used = call(self._h.dram, int(chip))
        return int(cap), int(used)

    def load_calbin(
        self,
        config: ModelConfig,
        weights: Mapping[str, np.ndarray],
        spec: ProfileSpec,
        timing: Timing | None = None,
        chip: int = 0,
        kv_owner: Calbin | None = None,
    ) -> Calbin:
        """CreateCalbin + configure + KvManager on ``chip``; charges weights + KV DRAM.

        ``kv_owner`` (C3 shared KV, sim-next only): an already loaded calbin of the same model; the new
        calbin joins its KV group — the same KvManager (sequence ids, committed lengths, KV memory) and
        the same weights, charged once: the new calbin costs only its own pools (activation scratch).
        KvManager methods and jobs on any member act on the shared sequences; a sequence in use by a job
        on one member is in use for all. ``weights`` must be the very same arrays as the owner's,
        ``config`` equal, ``spec.max_seq`` / ``max_sequences`` / ``kv_dtype`` equal, ``chip`` the same
        (``compiled_batch``, ``valid_mask`` and ``timing`` may differ); else :class:`InvalidArgument`
        naming what differs. Without ``capabilities.shared_kv``: :class:`NotSupported`.

        Weights (HF names, float32, shapes per :func:`weight_shapes`) are NOT copied: the arrays are
        kept referenced until ``release``. With ``null_compute`` weights may be ``{}``.
        Raises :class:`InvalidArgument` (a name/shape/dtype mismatch, naming the tensor),
        :class:`NotSupported` (B>1 without batch profiles, second resident calbin without
        multi-calbin, chip>0 without chip-scoped configure), :class:`OutOfDeviceMemory`.
        """
        shapes = weight_shapes(config)
        tensors: list[tuple[str, Any]] = []
        if weights or not self.null_compute:
            extra = sorted(set(weights) - set(shapes))
            if extra:
                raise InvalidArgument(f"weights: unexpected tensor {extra[0]!r}", 1)
            for name, shape in shapes.items():
                if name not in weights:
                    raise InvalidArgument(f"weights: missing tensor {name!r}", 1)
                w = weights[name]
                if not isinstance(w, np.ndarray) or w.dtype != np.float32:
                    raise InvalidArgument(f"weights[{name!r}]: dtype must be float32", 1)
                if tuple(w.shape) != shape:
                    raise InvalidArgument(
                        f"weights[{name!r}]: shape {tuple(w.shape)} != expected {shape}", 1
                    )
                if not w.flags.c_contiguous:
                    raise InvalidArgument(f"weights[{name!r}]: must be C-contiguous", 1)
                tensors.append((name, w))
        if spec.kv_dtype not in ("fp32", "bf16"):
            raise InvalidArgument(f"spec.kv_dtype must be 'fp32' or 'bf16', not {spec.kv_dtype!r}", 1)
        if spec.inactive_writes_kv:
            raise InvalidArgument("spec.inactive_writes_kv: calrt-sim never writes KV from inactive "
                                  "lanes; such a profile is not usable", 1)
        c = config
        model = (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                 c.num_attention_heads, c.num_key_value_heads, c.head_dim, float(c.rms_norm_eps),
                 float(c.rope_theta), bool(c.tie_word_embeddings),
                 _ARCH_CODES[c.architecture], c.sliding_window, c.sliding_window_pattern,
                 float(c.rope_local_theta), float(c.query_pre_attn_scalar),
                 float(c.rope_scaling_factor), float(c.attn_logit_softcapping),
                 float(c.final_logit_softcapping))
        prof = (spec.compiled_batch, spec.max_seq, spec.max_sequences,
                1 if spec.kv_dtype == "bf16" else 0, bool(spec.valid_mask), bool(spec.inactive_logits))
        t = timing or Timing()
        if not 0.0 <= t.pingpong_overlap <= 1.0:
            raise InvalidArgument("timing.pingpong_overlap must be in [0, 1]", 1)
        tim = (float(t.prefill_base_us), float(t.prefill_us_per_token),
               t.step_us(spec.compiled_batch), float(t.pingpong_overlap))
        owner_h = None
        if kv_owner is not None:
            if not self.capabilities.shared_kv:
                raise NotSupported(f"kv_owner: shared KV across calbins (C3) is not supported by runtime "
                                   f"profile {self.profile}", 2)
            if not isinstance(kv_owner, Calbin) or kv_owner._device is not self or kv_owner.released:
                raise InvalidArgument("kv_owner: must be a loaded, not released Calbin of this device", 1)
            if kv_owner.chip != int(chip):
                raise InvalidArgument(f"kv_owner: is on chip {kv_owner.chip}, not chip {int(chip)} (KV "
                                      "lives in one chip's DRAM)", 1)
            owner_h = kv_owner._h
        h = call(self._h.load_calbin, int(chip), model, tensors, prof, tim, owner_h)
        cb = Calbin(self, h, config, spec, int(chip), kv_owner)
        self._calbins.append(cb)
        return cb

    def _forget(self, cb: Calbin) -> None:
        if cb in self._calbins:
            self._calbins.remove(cb)

    def calbins(self) -> list[Calbin]:
        """Calbins loaded through this device and not yet released."""
        return list(self._calbins)

    def reset(self, chip: int | None = None) -> None:
        """Reset one chip (or all with ``None``): every in-flight job completes ``ABORTED``, every KV
        sequence is invalidated, faults are cleared. Weights stay configured unless a ``DMA_UNKNOWN``
        happened (then ``needs_reconfigure`` until each calbin is reconfigured)."""
        call(self._h.reset, -1 if chip is None else int(chip))

    @property
    def needs_reconfigure(self) -> bool:
        """True while any chip's calbins must be reconfigured (after ``DMA_UNKNOWN``)."""
        return any(bool(self._h.needs_reconfigure(c)) for c in range(self.chips))

    def faulted(self, chip: int = 0) -> bool:
        """True while the chip refuses jobs until a reset (after CCU_FAULT / DMA_UNKNOWN)."""
        return bool(call(self._h.faulted, int(chip)))

    def counters(self, engine: JobEngine, chip: int = 0) -> EngineCounters:
        """Status counters of one engine (cumulative since open; ``inflight`` is current)."""
        s, c, f, b, t, i = call(self._h.counters, int(chip), int(engine))
        return EngineCounters(submitted=s, completed=c, failed=f, busy=b, timeouts=t, inflight=i)

    def completion_fd(self, engine: JobEngine, chip: int = 0) -> int | None:
        """The completion notification fd of one job engine, or ``None`` when this runtime build
        has none (a vendor libcalrt without ``calrt_sim_engine_completion_fd``: wait with
        :meth:`Job.wait` on a thread instead).

        A non-blocking Linux eventfd the engine increments after every job of ``(chip, engine)``
        completes (any status, ABORTED by a reset included), only once :meth:`Job.done` is already
        true. Protocol that never loses a wake-up: drain it (``os.eventfd_read``, ``BlockingIOError``
        = nothing pending), then :meth:`Job.result_nowait`; on ``None`` wait until the fd is
        readable and repeat. A count can be stale (a job waited for another way): one spurious
        wake-up. The same fd on every call; owned by the runtime: never close it; it is closed by
        :meth:`close` (stop waiting on it before). :class:`InvalidArgument` for a bad chip/engine.
        """
        try:
            return int(call(self._h.completion_fd, int(chip), int(engine)))
        except NotSupported:
            return None

    def inject_fault(
        self, kind: FaultKind, engine: JobEngine, nth: int, lane: int = 0, chip: int = 0
    ) -> None:
        """Sim only: make the ``nth`` (1-based) submit from now on ``engine`` hit ``kind``.

        ``DEVICE_BUSY`` refuses that submit; ``TIMEOUT`` parks the job until a reset (then
        ``ABORTED``); ``CCU_FAULT`` / ``DMA_UNKNOWN`` complete it with that status and fault the chip;
        ``CROSSTALK`` corrupts ``lane``'s logits after the checksum was taken. :class:`NotSupported` on
        a vendor build.
        """
        if nth < 1:
            raise InvalidArgument("nth must be >= 1", 1)
        call(self._h.inject_fault, int(chip), int(engine), int(kind), int(nth), int(lane))

    def __repr__(self) -> str:
        return f"Device(profile={self.profile!r}, chips={self.chips})"
