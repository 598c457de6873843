/* topp_core.h — the top-p (nucleus) cut of one row of sampling weights: the arithmetic of
 * calserve/engine/nucleus.py's numpy formulation (nucleus_mask) in two passes over the row.
 *
 * The weights are e = exp(x / T - max) in float64 (the row's maximum weighs exactly 1). The top 16
 * bits of a non-negative float64 are monotone in its value, so `bits >> 48` sorts the weights into 16
 * buckets per octave; bucket 0 holds the maximum, bucket TOPP_BUCKETS - 1 everything 64 octaves or
 * more below it. Pass 1 adds each weight to its bucket's mass in index order (numpy.bincount's
 * order: the same additions, so the same bits), then runs the cumulative mass from the top bucket
 * down, divided by the row's sum z (numpy.cumsum's order, then one division each), and finds the
 * first bucket whose cumulative mass reaches top_p (`bb`: the count of cumulative masses below it,
 * at most the last bucket) and the mass before it. Pass 2 zeroes every weight of a bucket below
 * the boundary (the buckets above it are kept whole) and lists the boundary bucket's token ids in
 * ascending order: which of them stay is decided by ranking them by logit, in Python (a few dozen
 * tokens). Every operation is an IEEE add, divide or compare in numpy's order, so the result is
 * bitwise that of the numpy formulation on every machine (tests/engine_parts/test_parts_topp.py
 * compares the two; ext/calrt/tests/test_topp.c checks the edges under ASan/UBSan).
 */
#ifndef CALSERVE_TOPP_CORE_H
#define CALSERVE_TOPP_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TOPP_BUCKETS 1025   /* 64 octaves x 16, then one bucket for the rest */
#define TOPP_TOP_KEY 0x3FF0 /* 1.0's top 16 bits: the bucket of the maximum weight */
#define TOPP_SPARE 8        /* scratch slots for the last bucket's weights */
#define TOPP_BLOCK 64       /* weights per boundary check in pass 2 */

/* The bucket of weight w (0: the maximum's; TOPP_BUCKETS - 1: 64 octaves or more below it). */
static inline int topp_bucket(double w) {
  uint64_t bits;
  memcpy(&bits, &w, sizeof bits);
  uint64_t k = bits >> 48;
  if (k > TOPP_TOP_KEY) k = TOPP_TOP_KEY;
  k = TOPP_TOP_KEY - k;
  if (k > TOPP_BUCKETS - 1) k = TOPP_BUCKETS - 1;
  return (int)k;
}

/* The cut of one row of v weights `e` (in place) with sum z: weights of the buckets below the
 * boundary set to +0.0, the boundary bucket's ids written to `cols` (ascending; room for v), their
 * count returned; *before: the cumulative mass (over z) of the buckets above the boundary. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static size_t topp_cut_row(double *e, size_t v, double z, double top_p, double *before,
                                  int64_t *cols) {
  /* The last bucket's mass changes nothing (the boundary is at most that bucket, and the mass
   * before the boundary never includes it): its weights go to TOPP_SPARE scratch slots in turn, so
   * a row whose bulk is 64 octaves down (a low temperature) does not wait on one slot's adds. */
  double mass[TOPP_BUCKETS + TOPP_SPARE];
  memset(mass, 0, sizeof mass);
  for (size_t i = 0; i < v; i++) {
    const int b = topp_bucket(e[i]);
    const int slot = b == TOPP_BUCKETS - 1 ? TOPP_BUCKETS + (int)(i % TOPP_SPARE) : b;
    mass[slot] += e[i];
  }
  double cum[TOPP_BUCKETS - 1];
  double acc = mass[0];
  int below = 0;
  for (int j = 0; j < TOPP_BUCKETS - 1; j++) {
    if (j > 0) acc = acc + mass[j];
    cum[j] = acc / z;
    below += cum[j] < top_p;
  }
  const int bb = below; /* at most the last bucket: every other one's cumulative mass is below top_p */
  *before = bb > 0 ? cum[bb - 1] : 0.0;
  /* Pass 2 on the float64 bits: bucket <= bb is bits >= lo, bucket == bb is lo <= bits < hi (hi
   * 0: no upper end), both from topp_bucket's definition (tests compare them with it). */
  const uint64_t lo = bb < TOPP_BUCKETS - 1 ? (uint64_t)(TOPP_TOP_KEY - bb) << 48 : 0;
  const uint64_t hi = bb > 0 ? (uint64_t)(TOPP_TOP_KEY - bb + 1) << 48 : 0;
  const uint64_t span = hi - lo; /* boundary: bits - lo < span (unsigned; hi 0 wraps to 2^64) */
  uint64_t *u = (uint64_t *)(void *)e;
  size_t n = 0;
  for (size_t s = 0; s < v; s += TOPP_BLOCK) {
    const size_t end = s + TOPP_BLOCK < v ? s + TOPP_BLOCK : v;
    uint64_t any = 0;
    for (size_t i = s; i < end; i++) { /* vectorised: one compare, one and, one or per weight */
      const uint64_t bits = u[i];
      any |= (uint64_t)(bits - lo < span);
      u[i] = bits >= lo ? bits : 0; /* +0.0 below the boundary */
    }
    if (any)
      for (size_t i = s; i < end; i++) {
        cols[n] = (int64_t)i;
        n += u[i] - lo < span;
      }
  }
  return n;
}

/* A grammar's token mask on one row of logits: every token whose bit (bit t % 32 of word t / 32) is
 * clear, or beyond the mask's nw words, set to -inf (float32 bits 0xFF800000); the rest untouched.
 * Branch-free: a mask that allows a scattered half of the vocabulary costs what any other does. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static void topp_mask_row(uint32_t *x, size_t v, const uint32_t *words, size_t nw) {
  const size_t full = nw < v / 32 ? nw : v / 32; /* whole words inside the row */
  for (size_t i = 0; i < full; i++) {
    const uint32_t wd = words[i];
    uint32_t *xr = x + 32 * i;
    if (wd == 0xFFFFFFFFu) continue; /* all 32 allowed: most words of a permissive state */
    for (int b = 0; b < 32; b++) {   /* vectorised: a variable shift per lane */
      const uint32_t allowed = 0u - ((wd >> b) & 1u);
      xr[b] = (xr[b] & allowed) | (0xFF800000u & ~allowed);
    }
  }
  for (size_t t = 32 * full; t < v; t++) { /* a partial last word, then what no word covers */
    const uint32_t allowed = t / 32 < nw ? 0u - ((words[t / 32] >> (t % 32)) & 1u) : 0u;
    x[t] = (x[t] & allowed) | (0xFF800000u & ~allowed);
  }
}

/* min-p on one row of weights: every weight below min_p set to +0.0 (the rest untouched). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
__attribute__((target_clones("avx2", "default")))
#endif
static void topp_drop_row(double *e, size_t v, double min_p) {
  for (size_t i = 0; i < v; i++) e[i] = e[i] < min_p ? 0.0 : e[i];
}

#endif
