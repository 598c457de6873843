/* Every matmul path of this CPU (matmul.c: default, avx2, avx512) against the contract's scalar
 * reduction, bitwise: odd sizes (in not a multiple of 8, out not a multiple of any tile, lanes not a
 * multiple of any tile's width), ranges [o0, o1) that split tiles, row counts that need several row
 * blocks, values of mixed magnitude (so a different order of additions would show). Run by
 * `make asan-test` at -O1 under ASan/UBSan and at the production -O3. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "v8f.h"

static uint64_t rng = 0x9E3779B97F4A7C15ULL;
static float frand(void) {
  rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
  const float u = (float)((rng >> 40) & 0xFFFFFF) / 16777216.0f - 0.5f;
  static const float mag[4] = {1.0f, 1e-3f, 37.0f, 1e4f};
  return u * mag[(rng >> 20) & 3];
}

static int failures = 0;

static void check(sim_isa_id isa, int out, int in, int R) {
  float *W = malloc(sizeof(float) * (size_t)out * in), *X = malloc(sizeof(float) * (size_t)R * in);
  float *Y = malloc(sizeof(float) * (size_t)R * out);
  for (size_t i = 0; i < (size_t)out * in; i++) W[i] = frand();
  for (size_t i = 0; i < (size_t)R * in; i++) X[i] = frand();
  memset(Y, 0xFF, sizeof(float) * (size_t)R * out); /* NaN: an unwritten element shows */
  /* the outputs in uneven pieces, as the pool's chunks (and leftovers) would cover them */
  for (int o0 = 0; o0 < out;) {
    int o1 = o0 + 1 + (int)(rng % 31);
    if (o1 > out) o1 = out;
    sim_matmul_range_isa(isa, W, out, in, X, R, Y, o0, o1);
    o0 = o1;
  }
  for (int r = 0; r < R; r++)
    for (int o = 0; o < out; o++) {
      const float want = sim_dot_ref(W + (size_t)o * in, X + (size_t)r * in, in);
      const float got = Y[(size_t)r * out + o];
      if (memcmp(&want, &got, sizeof want) != 0) {
        if (failures++ < 10)
          fprintf(stderr, "%s: out %d in %d R %d: Y[%d,%d] = %a, reference %a\n", sim_isa_name(isa), out,
                  in, R, r, o, got, want);
      }
    }
  free(W); free(X); free(Y);
}

/* hsum8x8 (the tiles' and attention's vector epilogue) against HSUM8 one accumulator at a time, bitwise:
 * mixed magnitudes (so another association would round differently), signed zeros, subnormals,
 * infinities of both signs (inf - inf = NaN on one path only would show) and NaNs (as NaN). */
static void check_hsum(void) {
  static const float special[] = {0.0f, -0.0f, 1e-45f, -1e-44f, 3.4e38f, -3.4e38f, __builtin_inff(),
                                  -__builtin_inff(), __builtin_nanf("")};
  for (int trial = 0; trial < 20000; trial++) {
    v8f a[8];
    for (int i = 0; i < 8; i++)
      for (int j = 0; j < 8; j++) {
        const float f = frand(); /* advances the generator for every element */
        a[i][j] = (rng % 17 == 0) ? special[(rng >> 8) % (sizeof special / sizeof *special)] : f;
      }
    const v8f s = hsum8x8(a);
    for (int i = 0; i < 8; i++) {
      const float want = HSUM8(a[i]), got = s[i];
      /* Any NaN matches a NaN: a compiler may swap an addition's operands (exact for numbers), and
       * with two NaN operands (or inf + -inf) which NaN comes out depends on the order, in HSUM8's
       * scalar code as much as here. */
      if (memcmp(&want, &got, sizeof want) != 0 && !(want != want && got != got) && failures++ < 10)
        fprintf(stderr, "hsum8x8: trial %d, accumulator %d: %a, HSUM8 %a\n", trial, i, got, want);
    }
  }
}

int main(void) {
  check_hsum();
  static const int ins[] = {1, 7, 8, 13, 64, 100, 576, 1003};
  static const int outs[] = {1, 5, 23, 24, 49, 97};
  static const int rs[] = {1, 2, 3, 4, 5, 6, 7, 9, 16, 17};
  int ran = 0;
  for (int isa = 0; isa < SIM_ISA_COUNT; isa++) {
    if (!sim_isa_supported((sim_isa_id)isa)) {
      printf("matmul path %s: not on this CPU\n", sim_isa_name((sim_isa_id)isa));
      continue;
    }
    for (size_t a = 0; a < sizeof ins / sizeof *ins; a++)
      for (size_t b = 0; b < sizeof outs / sizeof *outs; b++)
        for (size_t c = 0; c < sizeof rs / sizeof *rs; c++) check((sim_isa_id)isa, outs[b], ins[a], rs[c]);
    /* more rows than one row block holds (several passes over the weights) */
    const int in = 1003, R = sim_row_block(in) + 5;
    check((sim_isa_id)isa, 37, in, R);
    printf("matmul path %s: checked\n", sim_isa_name((sim_isa_id)isa));
    ran++;
  }
  if (failures || ran == 0) {
    fprintf(stderr, "matmul paths: %d mismatches\n", failures);
    return 1;
  }
  printf("calrt-sim matmul paths: OK (in use: %s)\n", sim_isa_name(sim_isa()));
  return 0;
}
