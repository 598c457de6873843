"""ModelSource: everything the engine needs from a verified model package (spec §11 steps 1-3).

:func:`load_sources` opens, verifies and reads every configured package (blocking file I/O: call it
from a thread); :func:`source_from_package` builds one source from a verified package. Tests build a
:class:`ModelSource` in memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from calserve.config import CalserveConfig
from calserve.runtime.reference import ModelConfig
from calserve.runtime.types import ProfileSpec, RuntimeCapabilities, Timing

__all__ = ["ModelSource", "source_from_package", "load_sources"]


@dataclasses.dataclass
class ModelSource:
    """Everything the engine needs from a (verified) model package."""

    alias: str
    model_config: ModelConfig
    weights: Mapping[str, np.ndarray]
    profiles: Mapping[int, ProfileSpec]  # compiled B -> spec
    eos_token_ids: tuple[int, ...]
    tokenizer: Any  # has decode(ids, skip_special_tokens=True) / encode(text)
    sha256: str = ""
    timing: Mapping[int, Timing] = dataclasses.field(default_factory=dict)  # per compiled B
    tiers: Mapping[int, str] = dataclasses.field(default_factory=dict)
    # (prompt tokens, {compiled B: expected greedy tokens}) checked after configure (spec §11 step 9)
    golden: Sequence[tuple[Sequence[int], Mapping[int, Sequence[int]]]] = ()
    verify: Any = None  # callable(info: dict, compiled_batch) raising on introspection mismatch


def source_from_package(pkg: Any, alias: str, timing_name: str | None = None) -> ModelSource:
    """Build a :class:`ModelSource` from a :class:`calserve.models.package.VerifiedPackage`."""
    from calserve.models.validate import compare_introspection

    m = pkg.manifest
    profiles = {b: m.profile_spec(b) for b in m.compiled_batches}
    timing: dict[int, Timing] = {}
    for b in profiles:
        timing[b] = m.timing_for(b)
    if timing_name is not None:
        from calserve.models.timing import timing_profile

        timing = {b: timing_profile(timing_name) for b in profiles}
    golden_cases: list[tuple[Sequence[int], Mapping[int, Sequence[int]]]] = []
    for case in pkg.golden().cases:
        golden_cases.append((list(case.prompt), {int(b): list(t) for b, t in case.expected.items()}))
    tok = pkg.tokenizer()
    return ModelSource(
        alias=alias,
        model_config=m.model_config(),
        weights=pkg.weights(),
        profiles=profiles,
        eos_token_ids=tuple(m.special_tokens.eos_token_ids),
        tokenizer=tok,
        sha256=pkg.sha256,
        timing=timing,
        tiers={p.compiled_batch: p.tier for p in m.profiles},
        golden=golden_cases,
        verify=lambda info, b: compare_introspection(m, b, info),
    )


def load_sources(cfg: CalserveConfig, caps: RuntimeCapabilities | None = None
                 ) -> dict[str, ModelSource]:
    """Spec §11 steps 1-3 for every configured model (blocking file I/O: call from a thread).

    ``package: null`` means the built-in demo package, built on first use. With the runtime's
    ``caps``, the configured batch profiles are cross-checked with each package's manifest before
    its weights are read (spec §15: a B8 the package lacks fails start-up, naming the key)."""
    from calserve.config import calserve_home
    from calserve.models.demo import ensure_demo_package
    from calserve.models.package import open_package
    from calserve.models.signing import TrustStore
    from calserve.models.validate import check_scheduler_config

    trust = TrustStore.from_config(cfg.trust)
    root = cfg.trust.model_root or str(calserve_home() / "models")
    out: dict[str, ModelSource] = {}
    for alias, entry in cfg.models.items():
        path = entry.package if entry.package is not None else str(ensure_demo_package())
        pkg = open_package(path, trust, root)
        if caps is not None:
            check_scheduler_config(pkg.manifest, cfg, caps)
        out[alias] = source_from_package(pkg, alias, entry.timing)
    return out
