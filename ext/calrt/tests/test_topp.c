/* test_topp.c — calserve.topp's cut (ext/topp_core.h) against a plain C reference of the numpy
 * formulation (calserve/engine/nucleus.py nucleus_mask before the boundary ranking): every bucket's
 * mass summed in index order, the cumulative masses over z, the boundary bucket, the mass before
 * it, the weights below it zeroed and the boundary's ids — compared bitwise on rows of every length
 * up to 200 and on 49,152, at low and high temperatures (bulk in the last bucket), with zero
 * weights, ties and top_p from 1e-9 to 1 - 2^-53; and the pass-2 bit ranges against topp_bucket
 * on every bucket edge. Run by `make asan-test` under ASan/UBSan and at -O3 (the AVX2 clone). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../topp_core.h"

#define XORSHIFT_SEED 0x9E3779B97F4A7C15ULL
#include "xorshift.h"
static double normal(void) { return sqrt(-2.0 * log(unit() + 0x1p-60)) * cos(6.283185307179586 * unit()); }

static long failures = 0, rows = 0;

/* The reference: one bucket per weight, in index order, no shortcut. */
static size_t ref_cut(double *e, size_t v, double z, double top_p, double *before, int64_t *cols) {
  double mass[TOPP_BUCKETS] = {0};
  for (size_t i = 0; i < v; i++) mass[topp_bucket(e[i])] += e[i];
  double cum[TOPP_BUCKETS], acc = 0.0;
  int below = 0;
  for (int j = 0; j < TOPP_BUCKETS; j++) {
    acc = j == 0 ? mass[0] : acc + mass[j];
    cum[j] = acc / z;
    if (cum[j] < top_p) below++;
  }
  const int bb = below < TOPP_BUCKETS - 1 ? below : TOPP_BUCKETS - 1;
  *before = bb > 0 ? cum[bb - 1] : 0.0;
  size_t n = 0;
  for (size_t i = 0; i < v; i++) {
    const int b = topp_bucket(e[i]);
    if (b > bb) e[i] = 0.0;
    if (b == bb) cols[n++] = (int64_t)i;
  }
  return n;
}

static void check_row(const double *w, size_t v, double top_p) {
  double *a = malloc(sizeof(double) * v), *b = malloc(sizeof(double) * v);
  int64_t *ca = malloc(sizeof(int64_t) * v), *cb = malloc(sizeof(int64_t) * v);
  if (!a || !b || !ca || !cb) exit(2);
  memcpy(a, w, sizeof(double) * v);
  memcpy(b, w, sizeof(double) * v);
  double z = 0.0; /* any positive sum: both sides divide by the same one */
  for (size_t i = 0; i < v; i++) z += w[i];
  double ba = -1.0, bref = -2.0;
  const size_t na = topp_cut_row(a, v, z, top_p, &ba, ca);
  const size_t nb = ref_cut(b, v, z, top_p, &bref, cb);
  rows++;
  if (na != nb || memcmp(&ba, &bref, sizeof ba) != 0 || memcmp(a, b, sizeof(double) * v) != 0 ||
      memcmp(ca, cb, sizeof(int64_t) * na) != 0) {
    if (failures++ < 10)
      fprintf(stderr, "topp: row of %zu, top_p %a: %zu boundary ids (reference %zu), before %a (%a)\n",
              v, top_p, na, nb, ba, bref);
  }
  free(a);
  free(b);
  free(ca);
  free(cb);
}

/* weights exp(s * normal / T - max): s / T from 0.01 (flat) to 200 (bulk 64 octaves down) */
static void weights(double *w, size_t v, double spread, double zeros, int ties) {
  double mx = -INFINITY;
  for (size_t i = 0; i < v; i++) {
    w[i] = spread * normal();
    if (ties) w[i] = round(w[i]);
    if (w[i] > mx) mx = w[i];
  }
  for (size_t i = 0; i < v; i++) {
    w[i] = exp(w[i] - mx);
    if (unit() < zeros) w[i] = 0.0;
  }
  w[(size_t)(unit() * (double)v) % v] = 1.0; /* the maximum */
}

int main(void) {
  static const double tps[] = {1e-9, 1e-6, 0.1, 0.5, 0.9, 0.95, 0.999999, 1.0 - 0x1p-53, 1.0};
  static const double spreads[] = {0.01, 1.0, 4.0, 30.0, 200.0};
  const size_t ntp = sizeof tps / sizeof tps[0], nsp = sizeof spreads / sizeof spreads[0];
  double *w = malloc(sizeof(double) * 49152);
  if (!w) return 2;
  for (size_t v = 1; v <= 200; v++)
    for (size_t k = 0; k < 6; k++) {
      weights(w, v, spreads[next() % nsp], k < 2 ? 0.0 : 0.3, (int)(k % 2));
      check_row(w, v, tps[next() % ntp]);
    }
  for (size_t s = 0; s < nsp; s++)
    for (size_t t = 0; t < ntp; t++) {
      weights(w, 49152, spreads[s], t % 3 == 0 ? 0.2 : 0.0, (int)(t % 2));
      check_row(w, 49152, tps[t]);
    }
  /* the bucket edges: the smallest weight of each bucket and the largest one below it */
  for (uint64_t k = 0x3FF0 - 1030; k <= 0x3FF0; k++) {
    double edge[2];
    const uint64_t lo = k << 48, below = lo - 1;
    memcpy(&edge[0], &lo, sizeof lo);
    memcpy(&edge[1], &below, sizeof below);
    double row[3] = {1.0, edge[0], edge[1]};
    for (size_t t = 0; t < ntp; t++) check_row(row, 3, tps[t]);
  }
  /* min-p: every weight below the bound to +0.0, the rest untouched (lengths 0..70: the vector
   * loop and its tail) */
  for (size_t v = 0; v <= 70; v++) {
    weights(w, v ? v : 1, 4.0, 0.2, 0);
    double got[70], bound = unit() * 0.5;
    memcpy(got, w, sizeof(double) * v);
    topp_drop_row(got, v, bound);
    for (size_t i = 0; i < v; i++) {
      const double want = w[i] < bound ? 0.0 : w[i];
      if (memcmp(&want, &got[i], sizeof want) != 0 && failures++ < 10)
        fprintf(stderr, "topp: drop_row(%a < %a) = %a\n", w[i], bound, got[i]);
    }
    rows++;
  }
  /* grammar masks: a token whose bit is clear, or beyond the mask's words, becomes -inf (lengths
   * 1..200, masks one word narrower to one word wider than the row; words full, empty, all but one
   * bit, one bit, random) */
  for (size_t v = 1; v <= 200; v++)
    for (int extra = -1; extra <= 1; extra++) {
      const size_t nw = (v + 31) / 32 + (size_t)(extra < 0 && (v + 31) / 32 == 1 ? 0 : extra);
      uint32_t words[16], x[200], y[200];
      for (size_t i = 0; i < nw; i++) {
        const uint64_t r = next();
        const uint32_t one = 1u << (r >> 40 & 31);
        words[i] = r % 5 == 0 ? 0xFFFFFFFFu : r % 5 == 1 ? 0u : r % 5 == 2 ? ~one : r % 5 == 3 ? one : (uint32_t)(r >> 32);
      }
      for (size_t t = 0; t < v; t++) x[t] = y[t] = (uint32_t)next();
      topp_mask_row(x, v, words, nw);
      for (size_t t = 0; t < v; t++) {
        const int allowed = t / 32 < nw && (words[t / 32] >> (t % 32) & 1u);
        const uint32_t want = allowed ? y[t] : 0xFF800000u;
        if (x[t] != want && failures++ < 10)
          fprintf(stderr, "topp: mask_row(v %zu, nw %zu) token %zu = %08x, want %08x\n", v, nw, t, x[t], want);
      }
      rows++;
    }
  free(w);
  printf("topp: %ld rows, %ld differ from the reference\n", rows, failures);
  return failures ? 1 : 0;
}
