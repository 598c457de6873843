"""The sampler's vocabulary truncations — the top-p (nucleus) set, min-p, grammar masks — and its
scratch buffers.

:func:`nucleus_mask` is the numpy formulation (issue 5; sessions 27-28): bucket masses over the
float bits of the weights locate the bucket where the cumulative mass in descending order crosses
top_p, and only that bucket's tokens are ranked. :func:`cut` applies the set to the weights in
place — with :mod:`calserve.topp` (``ext/topp.c``), the same arithmetic in the same order in two
passes over each row (so the same bits; ``tests/engine_parts/test_parts_topp.py`` compares them),
or with the mask when the extension is not built. At [16, 49,152] (SmolLM2's vocabulary at B16) on
a 2-vCPU AMD EPYC the numpy cut takes ~4 of a top-p draw's ~7.3 ms, the extension ~1.1-1.5 ms (with
the row sums and the boundary ranking); a top-p token at B16 403-527 -> 230-271 µs (session 33).
"""

from __future__ import annotations

import threading
from typing import Any, Final

import numpy as np
import numpy.typing as npt

__all__ = ["scratch", "nonzero2", "nucleus_of_sorted", "nucleus_mask", "cut", "drop_below", "apply_masks",
           "NATIVE"]

_ext: Any
try:
    from calserve import topp as _ext
except ImportError:  # not built (a source checkout without build_ext): numpy's formulation
    _ext = None

#: Whether :func:`cut` runs the extension.
NATIVE: Final = _ext is not None


_local = threading.local()


def scratch(shape: tuple[int, ...], dtype: type[np.generic], use: str) -> npt.NDArray[Any]:
    """A C-contiguous buffer of ``shape`` and ``dtype`` for one ``use`` in a sampling call, reused
    from call to call by the calling thread (the engine's; each use's buffer is consumed before
    the next call needs it, and nothing returned refers to one). At [16, 49k] every fresh
    temporary of the weights' size cost ~0.4 ms in page faults (a large allocation is a fresh
    mapping), which made a top-p draw twice as slow as its arithmetic. One buffer per use and row
    width, as many rows as the largest batch so far (a smaller batch gets its first rows): ~50 MB
    a thread at B16 on a 152k vocabulary, the three uses together."""
    bufs: dict[tuple[str, tuple[int, ...]], npt.NDArray[Any]] | None = getattr(_local, "bufs", None)
    if bufs is None:
        bufs = _local.bufs = {}
    key = (use, shape[1:])
    buf = bufs.get(key)
    if buf is None or buf.dtype != dtype or buf.shape[0] < shape[0]:
        if buf is None and len(bufs) >= 8:  # another model's width: drop the old ones
            bufs.clear()
        buf = bufs[key] = np.empty(shape, dtype=dtype)
    return buf[: shape[0]]


def nonzero2(mask: npt.NDArray[np.bool_]) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """``np.nonzero(mask)`` of a 2-D mask (rows, columns; row-major order): the same arrays from
    the flat indices, ~14x faster at [16, 49k] (numpy's 2-D nonzero takes ~1.4 ms there, most of
    a top-k draw)."""
    if mask.shape[1] == 0:
        return np.nonzero(mask)  # type: ignore[return-value]
    rows, cols = np.divmod(np.flatnonzero(mask), mask.shape[1])
    return rows, cols


def nucleus_of_sorted(
    q: npt.NDArray[np.float64], top_p: npt.NDArray[np.float64], before: npt.NDArray[np.float64]
) -> npt.NDArray[np.bool_]:
    """Keep mask of candidates sorted by probability: keep while the mass ranked before a token
    (``before`` + exclusive cumsum) is < top_p; never an empty set."""
    exclusive = before[:, None] + np.cumsum(q, axis=1) - q
    keep = (exclusive < top_p[:, None]) & (q > 0.0)
    keep[:, 0] |= before <= 0.0  # at least one: the most likely token
    return keep


# Probability buckets for the nucleus: the top 16 bits of a float64 (sign, exponent, 4 mantissa
# bits) are monotone in the value, so ``bits >> 48`` sorts weights into 16 buckets per octave.
_BUCKET_SHIFT: Final = np.uint64(48)
_BUCKETS: Final = 16 * 64 + 1  # 64 octaves below the maximum, then one bucket for the rest
_TOP_KEY: Final = 0x3FF0  # 1.0's top 16 bits: the bucket of the maximum weight


def _buckets(e: npt.NDArray[np.float64], out: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Each weight's bucket (0: the maximum's, ``_BUCKETS - 1``: everything 64 octaves below it),
    from its float64 bits, in place in ``out`` (one buffer: at [16, 49k] every fresh temporary of
    this size cost ~0.4 ms in page faults, the uint64 expressions ~5 ms in all)."""
    np.right_shift(e.view(np.uint64), _BUCKET_SHIFT, out=out.view(np.uint64))  # < 2**16
    np.minimum(out, _TOP_KEY, out=out)
    np.subtract(_TOP_KEY, out, out=out)
    np.minimum(out, _BUCKETS - 1, out=out)
    return out


def _boundary(e: npt.NDArray[np.float64], x: npt.NDArray[np.float32], z: npt.NDArray[np.float64],
              top_p: npt.NDArray[np.float64], before: npt.NDArray[np.float64],
              rows_i: npt.NDArray[np.intp], cols: npt.NDArray[np.intp],
              counts: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
    """The boundary buckets' tokens (``rows_i``, ``cols``; ``counts`` per row) of every row ranked
    by (logit desc, id asc), padded with id ``v``, and which of them the top-p set keeps."""
    m, v = e.shape
    width = max(int(counts.max()), 1)
    slot = np.arange(rows_i.size) - (np.cumsum(counts) - counts)[rows_i]
    ids = np.full((m, width), v, dtype=np.int64)
    vals = np.full((m, width), 0.0, dtype=np.float64)  # padding has no mass ...
    logit = np.full((m, width), -np.inf, dtype=np.float32)  # ... and sorts last
    ids[rows_i, slot] = cols
    vals[rows_i, slot] = e[rows_i, cols]
    logit[rows_i, slot] = x[rows_i, cols]
    order = np.lexsort((ids, -logit), axis=-1)
    ids = np.take_along_axis(ids, order, axis=1)
    q = np.maximum(np.take_along_axis(vals, order, axis=1), 0.0) / z[:, None]
    return ids, nucleus_of_sorted(q, top_p, before)


def nucleus_mask(e: npt.NDArray[np.float64], top_p: npt.NDArray[np.float64],
                  x: npt.NDArray[np.float32]) -> npt.NDArray[np.bool_]:
    """The top-p set of each row of weights ``e = exp(x/T - max)`` (max 1.0) without sorting the
    vocabulary.

    Bucket masses (a histogram over float bits) locate the bucket where the cumulative mass in
    descending order crosses top_p: buckets above it are kept whole, buckets below dropped, and
    only the tokens of that one bucket are sorted to find the exact cut, by (logit ``x`` desc,
    id asc): the order top-k and greedy use. Weights can tie where the logits do not (``exp`` of
    a difference below float64's resolution is 1.0: logits 0 and 2.8e-24 both weigh 1.0), and
    then the higher logit ranks first, as it does for greedy (found by a random-seed run)."""
    m, v = e.shape
    if m == 1:
        return _nucleus_one(e[0], float(top_p[0]), x[0])[None, :]
    z = e.sum(axis=1)
    flat = _buckets(e, scratch((m, v), np.int64, "buckets"))  # offset by its row's below
    off = np.arange(m, dtype=np.int64) * _BUCKETS
    flat += off[:, None]
    mass = np.bincount(flat.ravel(), weights=e.ravel(), minlength=m * _BUCKETS).reshape(m, _BUCKETS)
    cum = np.cumsum(mass, axis=1) / z[:, None]
    # First bucket whose inclusive cumulative mass reaches top_p (clipped: rounding near 1.0).
    bb = np.minimum(np.count_nonzero(cum < top_p[:, None], axis=1), _BUCKETS - 1)
    r = np.arange(m)
    before = np.where(bb > 0, cum[r, np.maximum(bb - 1, 0)], 0.0)
    cut = (bb + off)[:, None]
    keep = flat < cut
    rows_i, cols = nonzero2(flat == cut)
    ids, kb = _boundary(e, x, z, top_p, before, rows_i, cols, np.bincount(rows_i, minlength=m))
    kr, kc = nonzero2(kb & (ids < v))
    keep[kr, ids[kr, kc]] = True
    out: npt.NDArray[np.bool_] = keep & (e > 0.0)
    return out


def _nucleus_one(e: npt.NDArray[np.float64], top_p: float,
                 x: npt.NDArray[np.float32]) -> npt.NDArray[np.bool_]:
    """:func:`nucleus_mask` of one row: the same operations on its values in the same order
    (the row's sum and its buckets' masses reduce the same values the same way; the boundary
    bucket's tokens, unpadded, sort the same), without the batch's row bookkeeping — the default
    configuration (B1) draws every top-p token this way."""
    z = e.sum()
    bucket = _buckets(e, scratch((1, e.shape[0]), np.int64, "buckets")[0])
    cum = np.cumsum(np.bincount(bucket, weights=e, minlength=_BUCKETS)) / z
    bb = min(int(np.count_nonzero(cum < top_p)), _BUCKETS - 1)
    before = cum[bb - 1] if bb > 0 else 0.0
    keep = bucket < bb
    ids = np.flatnonzero(bucket == bb)
    order = np.lexsort((ids, -x[ids]))
    ids = ids[order]
    q = np.maximum(e[ids], 0.0) / z
    if ids.size:
        kept = nucleus_of_sorted(q[None, :], np.array([top_p]), np.array([before]))[0]
        keep[ids[kept]] = True
    out: npt.NDArray[np.bool_] = keep & (e > 0.0)
    return out


def cut(e: npt.NDArray[np.float64], top_p: npt.NDArray[np.float64],
        x: npt.NDArray[np.float32]) -> None:
    """``e *= nucleus_mask(e, top_p, x)``: every weight outside its row's top-p set set to 0,
    in place (``e`` C-contiguous [m, v], the weights of logits ``x``; ``top_p`` [m])."""
    m, v = e.shape
    if _ext is None or m == 0 or v == 0 or not e.flags.c_contiguous:
        np.multiply(e, nucleus_mask(e, top_p, x), out=e)
        return
    z = e.sum(axis=1)  # numpy's pairwise sum per row: the z nucleus_mask divides by
    before = np.empty(m, dtype=np.float64)
    counts = np.empty(m, dtype=np.int64)
    cols_buf = scratch((m, v), np.int64, "buckets")
    _ext.cut(e, z, np.ascontiguousarray(top_p, dtype=np.float64), before, counts, cols_buf)
    total = int(counts.sum())
    cols = cols_buf.ravel()[:total]
    if m == 1:
        # the boundary bucket's tokens ranked by (logit desc, id asc), as _nucleus_one does
        ids = cols[np.lexsort((cols, -x[0, cols]))]
        q = np.maximum(e[0, ids], 0.0) / z[0]
        if ids.size:
            kept = nucleus_of_sorted(q[None, :], top_p[:1], before[:1])[0]
            e[0, ids[~kept]] = 0.0
        return
    rows_i = np.repeat(np.arange(m), counts)
    ids, kb = _boundary(e, x, z, top_p, before, rows_i, cols, counts)
    dr, dc = nonzero2(~kb & (ids < v))  # boundary tokens outside the set
    e[dr, ids[dr, dc]] = 0.0


def drop_below(e: npt.NDArray[np.float64], min_p: npt.NDArray[np.float64]) -> None:
    """min-p on weights ``e = exp(x/T - max(x/T))``, in place: the best token's weight is exactly
    1, so ``p_t >= min_p * p_max`` is ``e_t >= min_p``, and every weight of row r below
    ``min_p[r]`` is set to 0 (min_p 0 keeps the row): ``numpy.copyto(e, 0.0, where=e < min_p[:,
    None])``, in one pass without the mask when the extension is built."""
    if _ext is not None and e.flags.c_contiguous and e.shape[0] > 0 and e.shape[1] > 0:
        _ext.drop_below(e, np.ascontiguousarray(min_p, dtype=np.float64))
        return
    np.copyto(e, 0.0, where=e < min_p[:, None])


def apply_masks(x: npt.NDArray[np.float32], rows: list[int], masks: list[npt.NDArray[np.int32]]) -> None:
    """Grammar masks on logits ``x`` [n, v] in place: row ``rows[j]``'s tokens whose bit in
    ``masks[j]`` (bit t % 32 of word t // 32) is clear, or beyond the mask, set to -inf. One
    branch-free pass a row with the extension (a mask allowing a scattered half of the vocabulary
    cost ~4 ms at [16, 49152] as numpy's masked copy, a mostly-allowed one ~0.3), else numpy."""
    n, vocab = x.shape
    words = np.stack(masks)
    if _ext is not None and x.flags.c_contiguous and words.dtype == np.int32:
        _ext.apply_mask(x, np.asarray(rows, dtype=np.int64), words)
        return
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    if bits.shape[1] < vocab:  # a mask narrower than the logits bans the rest
        bits = np.concatenate([bits, np.zeros((len(masks), vocab - bits.shape[1]), np.uint8)], axis=1)
    banned = bits == 0
    if len(rows) == n and rows == list(range(n)):  # every lane constrained: in place, no row copies
        np.copyto(x, np.float32(-np.inf), where=banned)
    else:
        idx = np.array(rows, np.int64)
        sub = x[idx]
        np.copyto(sub, np.float32(-np.inf), where=banned)
        x[idx] = sub
