/* matmul.c — the linear layers of calrt-sim: Y[r, o] = sum_k W[o, k] * X[r, k], fp32.
 *
 * The contract (what makes a lane's logits bitwise independent of B, its lane, its batch-mates, the
 * tile shape, the chunking, the thread count and the CPU): every output element is computed by the
 * one reduction sim_dot_ref() spells out in scalar code — eight lane accumulators over k in steps of 8
 * (lane j does a = fma(W[o,k], X[r,k], a) for k = j, j+8, ... in order: a fused multiply-add, one
 * rounding), the fixed tree ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), then the scalar tail k8..in-1 in
 * order, each a fused multiply-add too. The fusing is explicit (FMA instructions, fmaf()), never the
 * compiler's: the build keeps -ffp-contract=off, so no other multiply and add is ever fused and each
 * vector lane does exactly the scalar operations whatever the register width. (Until 2026-12-05 the
 * contract was a product rounded then added: two roundings, and on AMD Zen 4 ~9 % slower at B16, on
 * CPUs whose adds share the FMA ports up to half the rate.)
 *
 * Several code paths compute that same reduction; one is chosen once per process (sim_isa()):
 *   default  any CPU: tiles of 4 weight rows x 2 lanes with fmaf() per element; on x86-64 (one
 *            without FMA: fmaf() is a software fused multiply-add, slow and exact) sim_dot_ref()
 *            itself, output by output
 *   avx2     AVX2 + FMA, 16 ymm registers: tiles of 3 rows x 4 lanes (4 x 3 below 4 lanes, mm_avx2)
 *   avx512   AVX-512VL's 32 ymm registers: 6 rows x 4 lanes, so a weight vector loaded once feeds
 *            four lanes (fewer loads per multiply-add at B16); the arithmetic is still 256-bit v8f
 *            lane by lane (the same operations as above). The default on AMD (Zen 4 splits 512-bit
 *            operations: there they took 1.34x the time per multiply-add of 256-bit ones).
 *   avx512z  AVX-512DQ, the default elsewhere: 512-bit arithmetic, a zmm holding the eight
 *            accumulators of two lanes for one weight row (mm_avx512z below); 6 rows x 4 lane pairs.
 *            On a 2-vCPU Intel Xeon VM with AVX-512: B16 matmuls single-thread 1.2x avx512's (weights streamed).
 * A tile of 3+ rows (in a multiple of 8) ends with hsum8x8 (v8f.h): a lane's row sums, adjacent in Y,
 * as one vector, each by the same additions as HSUM8 (at B16 the element-by-element sums were ~10%
 * of the kernel's time on SmolLM2's shapes).
 * Decode B1 (one lane, memory-bound) streams one weight row after the other on every path.
 * CALRT_SIM_ISA=default|avx2|avx512|avx512z forces one (a path the CPU lacks falls back to the best it has);
 * the tests run every path and compare them bitwise with sim_dot_ref().
 *
 * Which (output, lane) pairs share a loaded weight vector is all a tile decides. Loop order: a group of
 * weight rows is loaded from memory once and applied to every lane of a row block (X rows stay in
 * L1/L2), so at decode each weight byte crosses the memory bus once per step.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

#include "v8f.h"

float sim_dot_ref(const float *w, const float *x, int n) {
  float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int n8 = n & ~7;
  for (int k = 0; k < n8; k += 8)
    for (int j = 0; j < 8; j++) a[j] = __builtin_fmaf(w[k + j], x[k + j], a[j]);
  float s = HSUM8(a);
  for (int k = n8; k < n; k++) s = __builtin_fmaf(w[k], x[k], s);
  return s;
}

/* acc + w * x, eight lanes, one rounding each: an FMA instruction on x86, whose tiles run only in
 * functions targeting FMA (the default path there is the scalar reference, below), else fmaf() per
 * element (v8f.h). The same bits either way. */
#if defined(__x86_64__) && defined(__GNUC__)
#define FMA8(acc, w, x) ((v8f)__builtin_ia32_vfmaddps256((__v8sf)(w), (__v8sf)(x), (__v8sf)(acc)))
#else
#define FMA8(acc, w, x) fma8(acc, w, x)
#endif

#define PF_LOCALITY 2 /* into L2 (prefetcht1): measured best against t0 / t2 / nta */
#define SMALL_BATCH_GROUP 12288 /* bytes of weight rows per tile group at <= 4 lanes (mm_avx512) */
#define B1_PF_AHEAD 8192 /* bytes: how far ahead decode B1 prefetches its weight rows (mm_body) */

/* RO weight rows x RL lanes: RO*RL independent accumulators, each the contract's reduction. pf: when
 * not NULL, memory read sequentially from pf on, pfn cache lines per k step: the next group's rows
 * reach L2 before they are needed. (The hardware prefetchers see RO short streams, one per row, and
 * learn each one too late.) The caller spreads one group's prefetches evenly over all the lane tiles
 * that use the current group: issued in a burst by the first tile alone (the old way), they fill the
 * core's miss buffers and stall the tile's own loads (single core, 2 MiB pages: B16 matmuls 5-25%
 * slower than spread; ~3% of a whole B16 step). */
static inline __attribute__((always_inline)) void tile(const float *restrict W, const float *restrict X,
                                                       float *restrict Y, int in, int out, int o0, int r0,
                                                       const int RO, const int RL, const char *pf, const int pfn) {
  v8f acc[8][4];
  for (int i = 0; i < RO; i++)
    for (int j = 0; j < RL; j++) acc[i][j] = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int k8 = in & ~7;
  const float *w0 = W + (size_t)o0 * in, *x0 = X + (size_t)r0 * in;
#define TILE_K_STEP(k)                                                                                 \
  do {                                                                                               \
    if (RO < RL) { /* the rows' weights held, the lanes' X streamed */                               \
      v8f wv[8];                                                                                     \
      for (int i = 0; i < RO; i++) wv[i] = ld8(w0 + (size_t)i * in + (k));                           \
      for (int j = 0; j < RL; j++) {                                                                 \
        const v8f xj = ld8(x0 + (size_t)j * in + (k));                                               \
        for (int i = 0; i < RO; i++) acc[i][j] = FMA8(acc[i][j], wv[i], xj);                         \
      }                                                                                              \
    } else { /* the lanes' X held, the rows' weights streamed */                                     \
      v8f xv[4];                                                                                     \
      for (int j = 0; j < RL; j++) xv[j] = ld8(x0 + (size_t)j * in + (k));                           \
      for (int i = 0; i < RO; i++) {                                                                 \
        const v8f w = ld8(w0 + (size_t)i * in + (k));                                                \
        for (int j = 0; j < RL; j++) acc[i][j] = FMA8(acc[i][j], w, xv[j]);                          \
      }                                                                                              \
    }                                                                                                \
  } while (0)
  if (!pf)
    for (int k = 0; k < k8; k += 8) TILE_K_STEP(k);
  else if (pfn == 1)
    for (int k = 0; k < k8; k += 8, pf += 64) {
      __builtin_prefetch(pf, 0, PF_LOCALITY);
      TILE_K_STEP(k);
    }
  else
    for (int k = 0; k < k8; k += 8) {
      for (int p = 0; p < pfn; p++) __builtin_prefetch(pf + 64 * p, 0, PF_LOCALITY);
      pf += 64 * pfn;
      TILE_K_STEP(k);
    }
#undef TILE_K_STEP
  if (RO >= 3 && k8 == in) { /* a lane's RO outputs are adjacent in Y: their sums as one vector */
    for (int j = 0; j < RL; j++) {
      v8f col[8];
      for (int i = 0; i < 8; i++) col[i] = i < RO ? acc[i][j] : (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      const v8f s = hsum8x8(col);
      memcpy(Y + (size_t)(r0 + j) * out + o0, &s, sizeof(float) * (size_t)RO);
    }
    return;
  }
  for (int i = 0; i < RO; i++)
    for (int j = 0; j < RL; j++) {
      float s = HSUM8(acc[i][j]);
      for (int k = k8; k < in; k++) s = __builtin_fmaf(w0[(size_t)i * in + k], x0[(size_t)j * in + k], s);
      Y[(size_t)(r0 + j) * out + o0 + i] = s;
    }
}

/* How the tiles of one weight-row group share the prefetch of the next group (pf: its first byte;
 * NULL: none): `per_step` lines a k step, each tile `tile_bytes` on from the one before, and no tile
 * once the group's end is reached (lanes() says why). lanes() and zlanes() both use it. */
typedef struct pf_plan {
  int per_step;
  size_t tile_bytes;
  const char *end;
} pf_plan;

static inline __attribute__((always_inline)) pf_plan pf_plan_for(const char *pf, int RO, int in, int tiles) {
  const int steps = tiles * (in / 8 > 0 ? in / 8 : 1);
  const int per_step = pf ? (RO * in / 16 + steps - 1) / steps : 0;
  return (pf_plan){per_step, (size_t)64 * per_step * (size_t)(in / 8), pf ? pf + (size_t)4 * RO * in : NULL};
}

/* The next tile's prefetch start (NULL once the group is covered). */
static inline __attribute__((always_inline)) const char *pf_next(const char *pf, const pf_plan *plan) {
  return pf && pf + plan->tile_bytes < plan->end ? pf + plan->tile_bytes : NULL;
}

/* Lanes [rb, re) against weight rows [o, o + RO): full RL-lane tiles, then one narrower tile. pf (if
 * not NULL): the RO rows that follow, prefetched a part by each tile (ceil(lines / (tiles * k steps))
 * lines per k step, so the group is covered whatever the tile count), and no tile after the one that
 * reaches the group's end: rounded up to a line per k step, the tiles would cover up to tiles x k steps
 * lines, for avx2's 4 x 3 tiles of the time at B16 three times the group (the rows of the next two
 * groups again, ~2 prefetch instructions for each line needed). Dropping them: avx2 B16 matmuls single thread
 * 1.15-1.25x faster (2-vCPU AMD EPYC Zen 3); avx512z's two tiles never reached the group's end. */
static inline __attribute__((always_inline)) void lanes(const float *W, const float *X, float *Y, int in,
                                                        int out, int o, int rb, int re, const int RO,
                                                        const int RL, const char *pf) {
  const pf_plan plan = pf_plan_for(pf, RO, in, (re - rb + RL - 1) / RL);
  const int pfn = plan.per_step;
  int r = rb;
  for (; r + RL <= re; r += RL, pf = pf_next(pf, &plan)) tile(W, X, Y, in, out, o, r, RO, RL, pf, pfn);
  switch (re - r) {
  case 3: if (RL > 3) tile(W, X, Y, in, out, o, r, RO, 3, pf, pfn); break;
  case 2: if (RL > 2) tile(W, X, Y, in, out, o, r, RO, 2, pf, pfn); break;
  case 1: if (RL > 1) tile(W, X, Y, in, out, o, r, RO, 1, pf, pfn); break;
  default: break;
  }
}

int sim_row_block(int in) {
  int rb = SIM_XBLOCK_FLOATS / (in > 0 ? in : 1);
  return rb < 16 ? 16 : rb;
}

/* Outputs [o0, o1) of every row. R == 1 (decode B1, memory-bound): one weight row after the other,
 * a single sequential stream the hardware prefetcher follows at full memory speed (several rows at a
 * time would be several short streams it learns too late). Otherwise ROB x RLB tiles over blocks of
 * lanes, each group of ROB weight rows prefetched ahead by software; leftover outputs one by one. */
static inline __attribute__((always_inline)) void mm_body(const float *W, int out, int in, const float *X,
                                                          int R, float *Y, int o0, int o1, const int ROB,
                                                          const int RLB) {
  if (R == 1) {
    /* Decode B1 streams its weight rows and nothing else: software-prefetch each row's worth of
     * lines B1_PF_AHEAD bytes ahead (never past this call's rows), so the memory pipe stays full
     * across row ends. SmolLM2 B1, 2 threads, same build alternated: 39.7-40.4 -> 44.7-46.0 tok/s
     * (1 KB ahead 43.3; 2-16 KB all ~45). With fused multiply-adds (a lane's chain waits 4 cycles a
     * k step on Zen 4 instead of 3) 8 KB: one thread, bench_matmul R=1, gate/up and lm_head 6.2 ->
     * 6.9-7.4 G multiply-adds/s, down 5.6 -> 5.7 (4 KB before: 5.7-6.0 and 6.3-6.4); the 2-thread
     * SmolLM2 B1 step as before (bandwidth-bound). */
    const char *end = (const char *)(W + (size_t)o1 * in);
    for (int o = o0; o < o1; o++) {
      const char *p = (const char *)(W + (size_t)o * in) + B1_PF_AHEAD, *pe = p + (size_t)in * 4;
      for (; p < pe && p < end; p += 64) __builtin_prefetch(p, 0, PF_LOCALITY);
      tile(W, X, Y, in, out, o, 0, 1, 1, NULL, 0);
    }
    return;
  }
  const int blk = sim_row_block(in);
  const char *end = (const char *)(W + (size_t)o1 * in);
  for (int rb = 0; rb < R; rb += blk) {
    const int re = rb + blk < R ? rb + blk : R;
    int o = o0;
    for (; o + ROB <= o1; o += ROB) {
      const char *pf = (const char *)(W + (size_t)(o + ROB) * in);
      lanes(W, X, Y, in, out, o, rb, re, ROB, RLB, pf + (size_t)4 * ROB * in <= end ? pf : NULL);
    }
    for (; o < o1; o++) lanes(W, X, Y, in, out, o, rb, re, 1, RLB, NULL);
  }
}

static void mm_default(const float *W, int out, int in, const float *X, int R, float *Y, int o0, int o1) {
#if defined(__x86_64__) && defined(__GNUC__)
  /* an x86-64 without FMA (or CALRT_SIM_ISA=default): the contract itself, an fmaf() call a
   * multiply-add either way, so the tiles would gain nothing */
  for (int r = 0; r < R; r++)
    for (int o = o0; o < o1; o++) Y[(size_t)r * out + o] = sim_dot_ref(W + (size_t)o * in, X + (size_t)r * in, in);
#else
  mm_body(W, out, in, X, R, Y, o0, o1, 4, 2);
#endif
}

#if defined(__x86_64__) && defined(__GNUC__)
#define SIM_HAVE_X86 1
/* 3 rows x 4 lanes: 12 accumulators, the three rows' weight vectors held while each lane's X streams
 * past them, and B16 is four whole tiles (4 x 3 left a 1-lane tile of four accumulator chains, too few
 * to keep both FMA pipes busy). Bitwise the same (the contract), faster on a 2-vCPU AMD EPYC (Zen 2/3,
 * AVX2), bench_matmul-style, old and new alternated in one process, weights streamed: R=16 gate/up,
 * down, lm_head 1.05-1.11x, R=4 1.06-1.19x, R=8/12 1.00-1.11x; SmolLM2 B16 step, 2 threads, 3 pairs of
 * bench/runtime_bench.py runs: 38.7-40.2 -> 36.6-37.0 ms. At 2-3 lanes 4 x 3 stays (3 x 4 was 2-7%
 * slower there). */
__attribute__((target("avx2,fma"))) static void mm_avx2(const float *W, int out, int in, const float *X, int R,
                                                    float *Y, int o0, int o1) {
  if (R > 3) mm_body(W, out, in, X, R, Y, o0, o1, 3, 4);
  else mm_body(W, out, in, X, R, Y, o0, o1, 4, 3);
}

/* A batch of at most 4 lanes streams each weight-row group from memory for one tile: groups of ~9-12
 * KB (4 rows of 576, 2 of 1536) rather than 6 rows (14-37 KB). SmolLM2 R=4, one thread, G multiply-
 * adds/s (gate/up, down, lm_head): 6 rows 22.4-23.7 / 20.6-21.1 / 23.7-24.0, this 24.1-24.4 / 23.8-23.9
 * / 25.8-26.7. */
__attribute__((target("avx2,fma,avx512f,avx512vl"))) static void mm_avx512(const float *W, int out, int in,
                                                                       const float *X, int R, float *Y,
                                                                       int o0, int o1) {
  if (R > 4) mm_body(W, out, in, X, R, Y, o0, o1, 6, 4);
  else if ((size_t)in * 4 * 4 <= SMALL_BATCH_GROUP) mm_body(W, out, in, X, R, Y, o0, o1, 4, 4);
  else mm_body(W, out, in, X, R, Y, o0, o1, 2, 4);
}

/* avx512z: the same reduction with 512-bit arithmetic. A zmm register holds two 8-float accumulators
 * of one weight row: lanes r and r + 1 (an X "pair", repacked once per row block into a buffer where
 * the two lanes' k..k+7 sit side by side), the weight row's k..k+7 broadcast to both halves. Each
 * element still does exactly the scalar operations of the contract (a fused multiply-add into its own
 * accumulator, k in order), so the bits are those of every other path; the multiply-adds are half as
 * many instructions. Tiles: 6 rows x 4 pairs (24 zmm accumulators). An odd lane count
 * pairs the last lane with zeros (computed, never stored). */
typedef float v16f __attribute__((vector_size(64)));

#define ZPAIRS 4
#define ZBUF_FLOATS (SIM_XBLOCK_FLOATS + 4096 + 16)
static __thread _Alignas(64) float zbuf[ZBUF_FLOATS]; /* a thread's repacked X pairs */

__attribute__((target("avx2,fma,avx512f,avx512vl,avx512dq"))) static inline __attribute__((always_inline)) v16f
bcast8(const float *p) { /* vbroadcastf32x8 zmm, m256: a load, no shuffle */
  return (v16f)_mm512_broadcast_f32x8(_mm256_loadu_ps(p));
}

/* RO weight rows from o0 x RP pairs from pair p0 of the repacked block (lanes rb + 2 * p0 ...);
 * nl: real lanes in this tile (2 * RP, or one less for an odd last lane). */
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512dq"))) static inline __attribute__((always_inline)) void
ztile(const float *restrict W, const float *restrict X, const float *restrict XP, float *restrict Y, int in,
      int out, int o0, int rb, int p0, const int RO, const int RP, int nl, const char *pf, const int pfn) {
  v16f acc[6][ZPAIRS];
  for (int i = 0; i < RO; i++)
    for (int j = 0; j < RP; j++) acc[i][j] = (v16f){0};
  const int k8 = in & ~7;
  const float *w0 = W + (size_t)o0 * in, *xp0 = XP + (size_t)p0 * 2 * k8;
  for (int k = 0; k < k8; k += 8) {
    if (pf) {
      for (int p = 0; p < pfn; p++) __builtin_prefetch(pf + 64 * p, 0, PF_LOCALITY);
      pf += 64 * pfn;
    }
    v16f xv[ZPAIRS];
    for (int j = 0; j < RP; j++) memcpy(&xv[j], xp0 + (size_t)j * 2 * k8 + 2 * k, sizeof xv[j]);
    for (int i = 0; i < RO; i++) {
      const v16f w = bcast8(w0 + (size_t)i * in + k);
      for (int j = 0; j < RP; j++) acc[i][j] = (v16f)_mm512_fmadd_ps((__m512)w, (__m512)xv[j], (__m512)acc[i][j]);
    }
  }
  for (int j = 0; j < RP; j++)
    for (int h = 0; h < 2; h++) {
      const int r = rb + 2 * (p0 + j) + h;
      if (2 * j + h >= nl) break;
      v8f col[8];
      for (int i = 0; i < 8; i++) {
        col[i] = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (i < RO) memcpy(&col[i], (const float *)&acc[i][j] + 8 * h, sizeof col[i]);
      }
      if (RO >= 4 && k8 == in) {
        const v8f s = hsum8x8(col);
        memcpy(Y + (size_t)r * out + o0, &s, sizeof(float) * (size_t)RO);
        continue;
      }
      for (int i = 0; i < RO; i++) {
        float s = HSUM8(col[i]);
        for (int k = k8; k < in; k++) s = __builtin_fmaf(w0[(size_t)i * in + k], X[(size_t)r * in + k], s);
        Y[(size_t)r * out + o0 + i] = s;
      }
    }
}

/* Lanes [rb, re) (repacked in XP from rb on) against weight rows [o, o + RO); pf as in lanes() (no
 * tile after the one reaching the group's end). */
__attribute__((target("avx2,fma,avx512f,avx512vl,avx512dq"))) static inline __attribute__((always_inline)) void
zlanes(const float *W, const float *X, const float *XP, float *Y, int in, int out, int o, int rb, int re,
       const int RO, const char *pf) {
  const int pairs = (re - rb + 1) / 2;
  const pf_plan plan = pf_plan_for(pf, RO, in, (pairs + ZPAIRS - 1) / ZPAIRS);
  const int pfn = plan.per_step;
  int p = 0;
  for (; p + ZPAIRS <= pairs; p += ZPAIRS, pf = pf_next(pf, &plan)) {
    const int nl = re - rb - 2 * p < 2 * ZPAIRS ? re - rb - 2 * p : 2 * ZPAIRS;
    ztile(W, X, XP, Y, in, out, o, rb, p, RO, ZPAIRS, nl, pf, pfn);
  }
  const int nl = re - rb - 2 * p;
  switch (pairs - p) {
  case 3: ztile(W, X, XP, Y, in, out, o, rb, p, RO, 3, nl, pf, pfn); break;
  case 2: ztile(W, X, XP, Y, in, out, o, rb, p, RO, 2, nl, pf, pfn); break;
  case 1: ztile(W, X, XP, Y, in, out, o, rb, p, RO, 1, nl, pf, pfn); break;
  default: break;
  }
}

__attribute__((target("avx2,fma,avx512f,avx512vl,avx512dq"))) static void mm_avx512z(const float *W, int out,
                                                                                  int in, const float *X,
                                                                                  int R, float *Y, int o0,
                                                                                  int o1) {
  const int k8 = in & ~7;
  int blk = sim_row_block(in);
  if (blk * in + in > ZBUF_FLOATS) blk = (ZBUF_FLOATS / in - 1) & ~1;
  if (R == 1 || k8 == 0 || blk < 2) { /* B1 streams rows (memory-bound); a huge row: the ymm path */
    mm_body(W, out, in, X, R, Y, o0, o1, 6, 4);
    return;
  }
  /* The buffer's address once (an opaque value): in a shared library each use of a __thread variable
   * may be a __tls_get_addr call, and GCC re-derived it inside the tile loops, spilling the
   * accumulators around each call (B16 1.35x slower than avx512). */
  float *zb = zbuf;
  __asm__("" : "+r"(zb));
  const char *end = (const char *)(W + (size_t)o1 * in);
  for (int rb = 0; rb < R; rb += blk) {
    const int re = rb + blk < R ? rb + blk : R;
    for (int r = rb; r < re; r += 2) { /* pair (r, r + 1): [x_r k..k+7 | x_r+1 k..k+7] per k step */
      float *dst = zb + (size_t)(r - rb) * k8;
      const float *a = X + (size_t)r * in, *b = r + 1 < re ? X + (size_t)(r + 1) * in : NULL;
      for (int k = 0; k < k8; k += 8) {
        memcpy(dst + 2 * k, a + k, 8 * sizeof(float));
        if (b) memcpy(dst + 2 * k + 8, b + k, 8 * sizeof(float));
        else memset(dst + 2 * k + 8, 0, 8 * sizeof(float));
      }
    }
    int o = o0;
    for (; o + 6 <= o1; o += 6) {
      const char *pf = (const char *)(W + (size_t)(o + 6) * in);
      zlanes(W, X, zb, Y, in, out, o, rb, re, 6, pf + (size_t)4 * 6 * in <= end ? pf : NULL);
    }
    for (; o < o1; o++) zlanes(W, X, zb, Y, in, out, o, rb, re, 1, NULL);
  }
}
#endif

static const char *const isa_names[SIM_ISA_COUNT] = {"default", "avx2", "avx512", "avx512z"};

int sim_isa_supported(sim_isa_id isa) {
  switch (isa) {
  case SIM_ISA_DEFAULT: return 1;
#ifdef SIM_HAVE_X86
  case SIM_ISA_AVX2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  case SIM_ISA_AVX512: return sim_isa_supported(SIM_ISA_AVX2) && __builtin_cpu_supports("avx512f") &&
                              __builtin_cpu_supports("avx512vl");
  case SIM_ISA_AVX512Z: return sim_isa_supported(SIM_ISA_AVX512) && __builtin_cpu_supports("avx512dq");
#endif
  default: return 0;
  }
}

const char *sim_isa_name(sim_isa_id isa) { return isa >= 0 && isa < SIM_ISA_COUNT ? isa_names[isa] : "?"; }

/* AMD's AVX-512 cores up to Zen 4 split a 512-bit operation in two 256-bit halves: there a register-only
 * loop of 512-bit multiplies and adds took 1.34x the time per multiply-add of 256-bit ones, so
 * avx512z is not their default (CALRT_SIM_ISA=avx512z still runs it). */
static int zmm_slow(void) {
#ifdef SIM_HAVE_X86
  return __builtin_cpu_is("amd");
#else
  return 1;
#endif
}

/* The best path this CPU runs, or CALRT_SIM_ISA's (if the CPU has it). Racy first calls agree. */
sim_isa_id sim_isa(void) {
  static atomic_int chosen = -1;
  int c = atomic_load_explicit(&chosen, memory_order_relaxed);
  if (c >= 0) return (sim_isa_id)c;
#ifdef SIM_HAVE_X86
  __builtin_cpu_init();
#endif
  c = SIM_ISA_DEFAULT;
  for (int i = SIM_ISA_COUNT - 1; i > 0; i--)
    if (sim_isa_supported((sim_isa_id)i) && !(i == SIM_ISA_AVX512Z && zmm_slow())) {
      c = i;
      break;
    }
  const char *env = getenv("CALRT_SIM_ISA");
  if (env && *env)
    for (int i = 0; i < SIM_ISA_COUNT; i++)
      if (strcmp(env, isa_names[i]) == 0 && sim_isa_supported((sim_isa_id)i)) c = i;
  atomic_store_explicit(&chosen, c, memory_order_relaxed);
  return (sim_isa_id)c;
}

void sim_matmul_range_isa(sim_isa_id isa, const float *W, int out, int in, const float *X, int R, float *Y,
                          int o0, int o1) {
  switch (isa) {
#ifdef SIM_HAVE_X86
  case SIM_ISA_AVX512Z: mm_avx512z(W, out, in, X, R, Y, o0, o1); return;
  case SIM_ISA_AVX512: mm_avx512(W, out, in, X, R, Y, o0, o1); return;
  case SIM_ISA_AVX2: mm_avx2(W, out, in, X, R, Y, o0, o1); return;
#endif
  default: mm_default(W, out, in, X, R, Y, o0, o1); return;
  }
}
