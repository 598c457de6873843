"""The sampler's float64 exp (calserve/engine/fastexp.py, ext/vexp64.c): numpy's bits, always.

The vectorised path is glibc's exp computed four at a time; it is used only when the import-time
probe agrees with numpy.exp. These tests hold it to glibc's exp bitwise on millions of inputs (the
sampler's range, the whole double range, the table's rounding ties, specials) — and so to numpy.exp
where numpy's float64 exp is glibc's, element by element (CPUs without AVX-512). Where numpy runs
its own AVX-512 exp (a Zen 4, an AVX-512 Xeon), whose last bit differs from glibc's for some
inputs, the probe must switch the extension off; elsewhere with AVX2 and FMA it must switch it on.
The sampler draws the same tokens and logprobs either way.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import platform

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import calserve.engine.fastexp as fastexp
from calserve.engine.sampler import LaneSampling, sample_batch
from calserve.engine.types import SamplingParams


def _bits_equal(want: np.ndarray, got: np.ndarray) -> np.ndarray:
    return (want.view(np.uint64) == got.view(np.uint64)) | (np.isnan(want) & np.isnan(got))


def _ours(x: np.ndarray) -> np.ndarray:
    y = np.ascontiguousarray(x, dtype=np.float64).copy()
    assert fastexp._ext is not None
    fastexp._ext.exp_inplace(y)
    return y


def _libm_exp() -> np.ufunc:
    name = ctypes.util.find_library("m")
    assert name is not None, "no libm"
    f = ctypes.CDLL(name).exp
    f.restype, f.argtypes = ctypes.c_double, [ctypes.c_double]
    return np.frompyfunc(f, 1, 1)


_LIBM_EXP = _libm_exp()


def _glibc_exp(x: np.ndarray) -> np.ndarray:
    """libm's ``exp`` of every element, one call each (what calserve.vexp64 computes four at a time)."""
    x = np.ascontiguousarray(x, dtype=np.float64)
    return _LIBM_EXP(x).astype(np.float64).reshape(x.shape)


def _numpy_exp_is_glibc() -> bool:
    """Whether numpy's float64 exp gives glibc's bits here, over the probe's inputs (numpy calls libm
    element by element unless it dispatches to its own AVX-512 exp)."""
    x = fastexp.probe_sample()
    with np.errstate(all="ignore"):
        return bool(_bits_equal(np.exp(x), _glibc_exp(x)).all())


NUMPY_EXP_IS_GLIBC = _numpy_exp_is_glibc()


def _reference(x: np.ndarray) -> np.ndarray:
    """What the extension must give: glibc's exp (numpy.exp's bits too where those are glibc's)."""
    with np.errstate(all="ignore"):
        return np.exp(x) if NUMPY_EXP_IS_GLIBC else _glibc_exp(x)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_the_probe_switches_the_vector_path_on_where_the_cpu_has_it() -> None:
    assert fastexp._ext is not None, "calserve.vexp64 was not built"
    if platform.machine() == "x86_64" and {"avx2", "fma"} <= _cpu_flags():
        # on where numpy's exp is glibc's (the probe agreed with it), off where numpy runs its own
        assert fastexp.VECTORISED is NUMPY_EXP_IS_GLIBC
    x = fastexp.probe_sample()
    assert _bits_equal(_reference(x), _ours(x)).all()


def test_the_reference_is_glibc_and_numpy_where_numpy_is_glibc() -> None:
    x = np.array([0.0025, -2.97217822, 1.0, -700.0, 0.0, np.inf, -np.inf])
    with np.errstate(all="ignore"):
        assert _bits_equal(_glibc_exp(x), np.array([math.exp(v) if v < 700 else math.inf for v in x])).all()
        if NUMPY_EXP_IS_GLIBC:
            assert _bits_equal(np.exp(x), _glibc_exp(x)).all()


def test_bitwise_numpy_exp_on_millions_of_inputs() -> None:
    rng = np.random.default_rng(1)
    ranges = [
        rng.uniform(-60.0, 0.0, 2_000_000),  # the sampler's inputs: x / T - max
        rng.uniform(-800.0, 800.0, 500_000),  # both sides of the main path's |x| < 512
        -rng.exponential(4.0, 500_000),
        rng.uniform(-1e-15, 1e-15, 100_000),  # around |x| = 2^-54
        (rng.integers(-70_000, 70_000, 500_000) + 0.5) / (128 / np.log(2)),  # k's rounding ties
        rng.integers(0, 2**64, 500_000, dtype=np.uint64).view(np.float64),  # every bit pattern
        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 5e-324, -5e-324, 2.0**-54,
                  -(2.0**-54), np.nextafter(2.0**-54, 0), 512.0, -512.0, np.nextafter(512.0, 0),
                  709.782712893384, 709.7827128933841, -708.3964185322641, -745.1332191019411,
                  -745.1332191019412, 1e308, -1e308]),
    ]
    x = np.concatenate(ranges)
    want = _reference(x)
    got = _ours(x)
    bad = ~_bits_equal(want, got)
    assert not bad.any(), x[bad][:10]
    # every length (the 4-wide loop and its tail) and a strided view (numpy's exp is used there)
    for n in range(0, 9):
        assert _bits_equal(_reference(x[:n]), _ours(x[:n])).all()
    y = x[:1001].copy()[::2]
    ref = np.exp(y)
    fastexp.exp_inplace(y)
    assert _bits_equal(ref, y).all()


@given(hnp.arrays(np.float64, st.integers(0, 64), elements=st.floats(allow_nan=True, allow_infinity=True)))
def test_any_doubles(x: np.ndarray) -> None:
    assert _bits_equal(_reference(x), _ours(x)).all()


def test_the_sampler_draws_the_same_with_numpy_exp(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 49152)) * 4).astype(np.float32)
    settings = [SamplingParams(temperature=1.0, seed=3), SamplingParams(temperature=0.7, top_p=0.9, seed=4),
                SamplingParams(temperature=1.3, min_p=0.05, seed=5),
                SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.0, logprobs=3, seed=6)]
    lanes = [LaneSampling.from_params(settings[i % len(settings)], step=i) for i in range(16)]
    ours = sample_batch(x, lanes)
    monkeypatch.setattr(fastexp, "VECTORISED", False)
    theirs = sample_batch(x, lanes)
    assert ours.tokens.tolist() == theirs.tokens.tolist()
    assert ours.logprobs == theirs.logprobs


def test_the_probe_refuses_an_extension_that_differs_or_has_no_vector_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    class OffByOne:  # one element a bit off: the probe must notice
        @staticmethod
        def exp_inplace(a: np.ndarray) -> bool:
            with np.errstate(all="ignore"):
                np.exp(a, out=a)
            a.view(np.uint64)[0] += 1
            return True

    class Scalar:  # no AVX2 + FMA: libm element by element, no gain
        @staticmethod
        def exp_inplace(a: np.ndarray) -> bool:
            with np.errstate(all="ignore"):
                np.exp(a, out=a)
            return False

    monkeypatch.setattr(fastexp, "_ext", OffByOne)
    assert fastexp._agrees() is False
    monkeypatch.setattr(fastexp, "_ext", Scalar)
    assert fastexp._agrees() is False
    monkeypatch.setattr(fastexp, "_ext", None)
    assert fastexp._agrees() is False
