/* vexp.c's vector expf (every path this CPU runs) against the C library's expf and against glibc's
 * algorithm (its FMA build) in scalar C, bitwise:
 * the table against exp2l, a deterministic sample of bit patterns over the whole float range (every
 * sign and exponent), the edges of the special-case branch (|x| = 88, overflow and underflow
 * thresholds, subnormal results), +-0, subnormal inputs, +-inf, NaNs, the two inputs where
 * glibc's plain and FMA builds part, and the kernels' loops (SiLU, softmax exp) at every length
 * 0..40 with special elements mixed in. Run by `make asan-test` at -O1 under ASan/UBSan and at -O3.
 * (All 2^32 inputs: `make exp-exhaustive`.) */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int failures = 0;

static uint32_t bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
static float from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* glibc's expf normal path (sysdeps/ieee754/flt-32/e_expf.c) in scalar C; fused: its -mfma build,
 * where every multiply-add is one fma. */
static float ref(float x, int fused) {
  const double inv = 0x1.71547652b82fep+0 * 32, shift = 0x1.8p+52, xd = x;
  double kd = fused ? fma(xd, inv, shift) : inv * xd + shift;
  uint64_t ki;
  memcpy(&ki, &kd, 8);
  kd -= shift;
  const double r = fused ? fma(xd, inv, -kd) : inv * xd - kd;
  const uint64_t t = sim_vexp_tab[ki % 32] + (ki << 47);
  double s;
  memcpy(&s, &t, 8);
  const double c0 = 0x1.c6af84b912394p-5 / 32 / 32 / 32, c1 = 0x1.ebfce50fac4f3p-3 / 32 / 32,
               c2 = 0x1.62e42ff0c52d6p-1 / 32;
  const double z = fused ? fma(c0, r, c1) : c0 * r + c1, r2 = r * r;
  double y = fused ? fma(c2, r, 1.0) : c2 * r + 1.0;
  y = fused ? fma(z, r2, y) : z * r2 + y;
  return (float)(y * s);
}

static void fail(const char *what, float x, float want, float got) {
  if (failures++ < 20) printf("FAIL %s: x=%a (0x%08x) want %a (0x%08x) got %a (0x%08x)\n", what, x, bits(x), want,
                              bits(want), got, bits(got));
}

int main(void) {
  /* the table: bits(2^(i/32)) - (i << 47) */
  for (int i = 0; i < 32; i++) {
    const double d = (double)exp2l((long double)i / 32.0L);
    uint64_t u;
    memcpy(&u, &d, 8);
    if (u - ((uint64_t)i << 47) != sim_vexp_tab[i]) {
      printf("FAIL table[%d]\n", i);
      failures++;
    }
  }
  /* the inputs */
  enum { CAP = 1 << 18 };
  float *xs = malloc(sizeof(float) * CAP), *ys = malloc(sizeof(float) * CAP);
  int n = 0;
  for (uint64_t u = 0; u < (1ULL << 32); u += 65537) xs[n++] = from_bits((uint32_t)u); /* all exponents */
  for (int i = 0; i < 40000; i++) xs[n++] = -104.0f + 194.0f * (float)i / 40000.0f;  /* the normal range */
  static const float edges[] = {0.0f, -0.0f, 0x1p-149f, -0x1p-149f, 0x1p-126f, -0x1p-126f, 1e-30f, -1e-30f,
                                88.0f, -88.0f, 0x1.62e42ep6f, 0x1.62e430p6f, -0x1.9fe368p6f, -0x1.9fe36ap6f,
                                -0x1.9d1d9ep6f, -87.33654f, -87.0f, -100.0f, -103.9f, 88.5f, 88.72f, 89.0f,
                                1.0f, -1.0f, 0.5f, 0x1.04845ep+5f, -0x1.f8cbb2p+5f, INFINITY, -INFINITY, NAN,
                                -NAN};
  const int ne = (int)(sizeof edges / sizeof edges[0]);
  for (int i = 0; i < ne; i++) {
    const uint32_t b = bits(edges[i]);
    for (int d = -8; d <= 8; d++) xs[n++] = from_bits(b + (uint32_t)d); /* and their neighbours */
  }
  xs[n++] = from_bits(0x7fc00001u); /* NaN payloads */
  xs[n++] = from_bits(0xffa00000u);
  xs[n++] = from_bits(0x7f800001u);

  const sim_vexp_id used = sim_vexp_mode();
  printf("vexp: path in use: %s; %d inputs\n", sim_vexp_name(used), n);
  if (used == SIM_VEXP_SCALAR) printf("NOTE: scalar expf in use (CALRT_SIM_ISA=default, no FMA, or no match with this libm)\n");
#if defined(__x86_64__) && defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 28)
  /* glibc's x86-64 expf is this algorithm, its FMA build where the CPU has FMA and AVX2: then the
   * vector path must match it (else the path is broken and the kernels fell back to scalar) */
  const sim_isa_id isa = sim_isa();
  if (sim_vexp_supported(SIM_VEXP_AVX2) && isa != SIM_ISA_DEFAULT && used == SIM_VEXP_SCALAR) {
    printf("FAIL glibc on an FMA CPU: the vector expf does not match expf\n");
    failures++;
  }
#endif
  /* glibc's two builds part on these inputs (what sim_vexp_mode's probe rests on) */
  const float px = from_bits(0x4202422fu);
  if (bits(ref(px, 0)) == bits(ref(px, 1))) fail("probe does not separate plain and fused", px, ref(px, 0), ref(px, 1));

  for (int m = SIM_VEXP_SCALAR; m < SIM_VEXP_COUNT; m++) {
    if (!sim_vexp_supported((sim_vexp_id)m)) {
      printf("vexp: %s not available on this CPU\n", sim_vexp_name((sim_vexp_id)m));
      continue;
    }
    /* every offset into the array, so each input meets every vector lane and the tails */
    for (int off = 0; off < 8; off++) {
      sim_vexp_n((sim_vexp_id)m, xs + off, ys + off, n - off);
      for (int i = off; i < n; i++) {
        const float x = xs[i];
        const int normal = fabsf(x) < 88.0f; /* else glibc's special branch: scalar expf everywhere */
        if (!normal || m == SIM_VEXP_SCALAR || m == (int)used) {
          const float want = expf(x);
          if (bits(want) != bits(ys[i])) fail(sim_vexp_name((sim_vexp_id)m), x, want, ys[i]);
        }
        if (normal && m != SIM_VEXP_SCALAR) {
          const float want = ref(x, 1);
          if (bits(want) != bits(ys[i])) fail(sim_vexp_name((sim_vexp_id)m), x, want, ys[i]);
        }
      }
    }
  }

  /* the kernels' loops against their scalar expressions */
  uint64_t rng = 0x9E3779B97F4A7C15ULL;
  for (int len = 0; len <= 40; len++)
    for (int rep = 0; rep < 20; rep++) {
      float g[48], u[48], g0[48], sc[48], sc0[48];
      for (int i = 0; i < len; i++) {
        rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
        const float v = (float)((rng >> 40) & 0xFFFFFF) / 16777216.0f - 0.5f;
        static const float mag[8] = {1.0f, 8.0f, 30.0f, 200.0f, 1e-3f, 100.0f, 16.0f, 4.0f};
        g[i] = g0[i] = v * mag[(rng >> 20) & 7];
        u[i] = (float)((rng >> 8) & 0xFFF) / 512.0f - 4.0f;
        sc[i] = sc0[i] = v * mag[(rng >> 24) & 7];
        if (((rng >> 30) & 63) == 0) g[i] = g0[i] = sc[i] = sc0[i] = ((rng >> 36) & 1) ? INFINITY : NAN;
      }
      const float mx = len ? sc0[0] : 0.0f;
      sim_silu_mul(g, u, len);
      sim_exp_shift(sc, len, mx);
      for (int i = 0; i < len; i++) {
        const float ws = (g0[i] / (1.0f + expf(-g0[i]))) * u[i];
        if (bits(ws) != bits(g[i])) fail("silu", g0[i], ws, g[i]);
        const float we = expf(sc0[i] - mx);
        if (bits(we) != bits(sc[i])) fail("exp_shift", sc0[i], we, sc[i]);
      }
    }
  free(xs);
  free(ys);
  if (failures) {
    printf("vexp: %d FAILURES\n", failures);
    return 1;
  }
  printf("vexp: all bitwise equal\n");
  return 0;
}
