/* vexp.c — expf eight floats at a time, bitwise equal to the C library's expf (SiLU, softmax).
 *
 * glibc's expf (since 2.28; ARM's optimized-routines algorithm, also musl's) evaluates in double:
 *   z = x * 32/ln2;  kd = z + 0x1.8p52 (rounds to an integer k in the low bits);  r = z - (kd - 0x1.8p52)
 *   s = 2^(k/32) = double(T[k % 32] + (k << 47));  y = (C0 r + C1) r^2 + (C2 r + 1);  expf = (float)(y s)
 * Every step is an IEEE double operation on one element, so each lane of a double vector does exactly
 * the scalar steps. One catch: x86-64 glibc picks at run time between that source compiled without FMA
 * and compiled with -mfma (used when the CPU has FMA and AVX2), where GCC fuses every multiply-add:
 * kd = fma(x, 32/ln2, shift), r = fma(x, 32/ln2, -kd), and the three polynomial steps. The two builds
 * give different floats for 2 of the ~2.2e9 inputs with |x| < 88 (0x1.04845ep+5, -0x1.f8cbb2p+5: r
 * from the unrounded product), so the vector code here is the fused build's, explicit FMA
 * instructions: on this project's hosts (FMA CPUs) it is bitwise equal to expf on all 2^32 inputs
 * (tests/exp_exhaustive.c, `make exp-exhaustive`: 0 mismatches). A CPU without FMA (or CALRT_SIM_ISA=
 * default) gets glibc's plain build, and the kernels call scalar expf: a plain-build vector
 * formulation in baseline SSE2 measured slower than scalar expf (5.3 vs 3.2 ns per element).
 *
 * Whether it is used is not assumed from the CPU but measured once per process (sim_vexp_mode()):
 * the vector code is compared with the process's own expf on the inputs where the two builds part plus
 * a sample of the range; only if it agrees bitwise on all of them is it used, else (another libm,
 * glibc's plain build) every element goes through scalar expf as before. Elements with |x| >= 88 or NaN
 * (glibc's special-case branch: overflow, underflow to 0, inf, NaN, errno) take scalar expf too, a
 * whole vector of 8 at a time (rare: |SiLU input| or a softmax score gap above 88). Elementwise
 * throughout: an element's result never depends on its neighbours or the vector width, so the batch
 * invariance (kernels.c) is untouched. Paths: avx2 (four doubles per ymm, table by gather) and avx512
 * (eight per zmm, table by two-source permutes; 0.5 vs 0.9 ns per element on Zen 4), the best one
 * sim_isa() allows (CALRT_SIM_ISA caps it).
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "internal.h"

#include "v8f.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define VEXP_X86 1
#endif


/* T[i] = bits(2^(i/32)) - (i << 47): glibc's __exp2f_data.tab (checked against exp2l in the test). */
const uint64_t sim_vexp_tab[32] = {
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51, 0x3fef72b83c7d517b,
    0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1, 0x3fef06fe0a31b715, 0x3feef1a7373aa9cb,
    0x3feedea64c123422, 0x3feece086061892d, 0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429,
    0x3feea47eb03a5585, 0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d, 0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069, 0x3fef5818dcfba487, 0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
};
#define VX_INVLN2N (0x1.71547652b82fep+0 * 32)
#define VX_SHIFT 0x1.8p+52
#define VX_C0 (0x1.c6af84b912394p-5 / 32 / 32 / 32)
#define VX_C1 (0x1.ebfce50fac4f3p-3 / 32 / 32)
#define VX_C2 (0x1.62e42ff0c52d6p-1 / 32)
#define VX_TOP12_88 0x42bu /* bits(88.0f) >> 20 */

/* The loops once per ISA: vexp_body.h defines exp8_SUFFIX and the kernels' loops exp_n_SUFFIX,
 * silu_SUFFIX, exp_shift_SUFFIX (tails, n % 8, through scalar expf). */
#ifdef VEXP_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define VEXP_SUFFIX avx2
#define VEXP_FUSED 1
#include "vexp_body.h"
#undef VEXP_SUFFIX
#undef VEXP_FUSED
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512vl")
#define VEXP_SUFFIX avx512
#define VEXP_FUSED 2
#include "vexp_body.h"
#undef VEXP_SUFFIX
#undef VEXP_FUSED
#pragma GCC pop_options
#endif

static void exp_n_scalar(const float *x, float *y, int n) {
  for (int i = 0; i < n; i++) y[i] = expf(x[i]);
}
static void silu_scalar(float *g, const float *u, int n) {
  for (int i = 0; i < n; i++) g[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}
static void exp_shift_scalar(float *x, int n, float m) {
  for (int i = 0; i < n; i++) x[i] = expf(x[i] - m);
}

/* The matmul path of the same name's CPU features (matmul.c, sim_isa_supported) plus FMA. */
static sim_isa_id vexp_isa(sim_vexp_id m) {
  return m == SIM_VEXP_AVX512 ? SIM_ISA_AVX512 : m == SIM_VEXP_AVX2 ? SIM_ISA_AVX2 : SIM_ISA_DEFAULT;
}

int sim_vexp_supported(sim_vexp_id m) {
  if (m == SIM_VEXP_SCALAR) return 1;
#ifdef VEXP_X86
  if (m == SIM_VEXP_AVX2 || m == SIM_VEXP_AVX512) {
    __builtin_cpu_init();
    return sim_isa_supported(vexp_isa(m)) && __builtin_cpu_supports("fma");
  }
#endif
  return 0;
}

static const char *const vexp_names[SIM_VEXP_COUNT] = {"scalar", "avx2", "avx512"};
const char *sim_vexp_name(sim_vexp_id m) { return m >= 0 && m < SIM_VEXP_COUNT ? vexp_names[m] : "?"; }

void sim_vexp_n(sim_vexp_id m, const float *x, float *y, int n) {
  switch (sim_vexp_supported(m) ? m : SIM_VEXP_SCALAR) {
#ifdef VEXP_X86
  case SIM_VEXP_AVX2: exp_n_avx2(x, y, n); return;
  case SIM_VEXP_AVX512: exp_n_avx512(x, y, n); return;
#endif
  default: exp_n_scalar(x, y, n); return;
  }
}

/* Does path m give expf's bits on the inputs where glibc's two builds part, and on a sample of
 * [-104, 89] (a few thousand points, ~20 us)? */
static int agrees(sim_vexp_id m) {
  enum { N = 1024, BLOCKS = 4 }; /* 8 KiB of stack: first called from whichever thread runs a kernel */
  static const uint32_t probes[] = {0x4202422fu, 0xc27c65d9u}; /* the plain build differs here */
  float x[N], y[N], want;
  for (int b = 0; b < BLOCKS; b++) {
    for (int i = 0; i < N; i++) x[i] = -104.0f + 193.0f * ((float)(i * BLOCKS + b) / (float)(N * BLOCKS));
    memcpy(&x[b], &probes[b & 1], 4);
    sim_vexp_n(m, x, y, N);
    for (int i = 0; i < N; i++) {
      want = expf(x[i]);
      if (memcmp(&want, &y[i], sizeof want) != 0) return 0;
    }
  }
  return 1;
}

/* The path in use: the best one sim_isa() allows that agrees with expf (measured once per process;
 * racy first calls agree). */
sim_vexp_id sim_vexp_mode(void) {
  static atomic_int chosen = -1;
  int c = atomic_load_explicit(&chosen, memory_order_relaxed);
  if (c >= 0) return (sim_vexp_id)c;
  const sim_isa_id isa = sim_isa();
  c = SIM_VEXP_SCALAR;
  for (int m = SIM_VEXP_COUNT - 1; m > SIM_VEXP_SCALAR; m--)
    if (vexp_isa((sim_vexp_id)m) <= isa && sim_vexp_supported((sim_vexp_id)m) && agrees((sim_vexp_id)m)) {
      c = m;
      break;
    }
  atomic_store_explicit(&chosen, c, memory_order_relaxed);
  return (sim_vexp_id)c;
}

void sim_silu_mul(float *g, const float *u, int n) {
  switch (sim_vexp_mode()) {
#ifdef VEXP_X86
  case SIM_VEXP_AVX2: silu_avx2(g, u, n); return;
  case SIM_VEXP_AVX512: silu_avx512(g, u, n); return;
#endif
  default: silu_scalar(g, u, n); return;
  }
}

void sim_exp_shift(float *x, int n, float m) {
  switch (sim_vexp_mode()) {
#ifdef VEXP_X86
  case SIM_VEXP_AVX2: exp_shift_avx2(x, n, m); return;
  case SIM_VEXP_AVX512: exp_shift_avx512(x, n, m); return;
#endif
  default: exp_shift_scalar(x, n, m); return;
  }
}
