"""float64 ``exp`` in place with numpy's bits, vectorised where numpy is not.

The sampler weighs the vocabulary by ``exp(x / T - max)`` in float64 (``sampler._exp_shifted``).
numpy vectorises float64 ``exp`` only on AVX-512 CPUs; elsewhere each element is a call of libm's
``exp``: 4 of the ~5 ms of a seeded B16 sampling step over SmolLM2's 49,152 tokens on a 2-vCPU AMD
EPYC (AVX2). :mod:`calserve.vexp64` (``ext/vexp64.c``) computes glibc's ``exp`` four elements at a
time with AVX2 and FMA, bit for bit. It is used only when a probe at import finds it equal to
``numpy.exp`` on this machine, bitwise, over a fixed sample (the sampler's range, the whole double
range, both paths' edges, specials); otherwise, or without the extension, :func:`exp_inplace` is
``numpy.exp``. Either way the sampler's draws are those it made with ``numpy.exp``. On an AVX-512
CPU (a Zen 4: 5,514 of the probe's 140,021 inputs differ in the last bit) numpy's own vectorised
exp is not glibc's, so the probe keeps ``numpy.exp`` there, vectorised already.
"""

from __future__ import annotations

import logging
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = ["exp_inplace", "VECTORISED"]

log = logging.getLogger(__name__)

_ext: Any
try:
    from calserve import vexp64 as _ext
except ImportError:  # not built (a source checkout without build_ext): numpy's exp
    _ext = None


def probe_sample() -> npt.NDArray[np.float64]:
    """The inputs the import-time probe compares (tests use more)."""
    rng = np.random.default_rng(20261205)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 5e-324, -5e-324, 2.0**-54, -(2.0**-54),
                      2.0**-55, 511.999, 512.0, -512.0, -512.001, 709.78, 709.79, -708.39, -745.13,
                      -745.14, -1e308, 1e308])
    return np.concatenate([
        rng.uniform(-60.0, 0.0, 60_000),  # the sampler's: x / T - max <= 0
        -rng.exponential(2.0, 20_000),
        rng.uniform(-800.0, 800.0, 20_000),
        (rng.integers(-60_000, 60_000, 20_000) + 0.5) / (128 / np.log(2)),  # table-index ties
        rng.integers(0, 2**64, 20_000, dtype=np.uint64).view(np.float64),  # every exponent
        edges,
    ])


def _agrees() -> bool:
    if _ext is None:
        return False
    x = probe_sample()
    with np.errstate(all="ignore"):
        want = np.exp(x)
    got = x.copy()
    if not _ext.exp_inplace(got):
        return False  # no AVX2 + FMA: libm element by element, no faster than numpy
    same = (want.view(np.uint64) == got.view(np.uint64)) | (np.isnan(want) & np.isnan(got))
    if not bool(same.all()):
        log.warning("calserve.vexp64 differs from numpy.exp on this machine (%d of %d inputs): "
                    "the sampler uses numpy.exp", int((~same).sum()), x.size)
        return False
    return True


VECTORISED: Final = _agrees()


def exp_inplace(a: npt.NDArray[np.float64]) -> None:
    """``a[...] = exp(a)`` for a float64 array, the bits of ``numpy.exp``."""
    if VECTORISED and a.flags.c_contiguous:
        _ext.exp_inplace(a)
    else:
        np.exp(a, out=a)
