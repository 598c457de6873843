/* kernels.c — the Qwen3 / Llama / Qwen2 / Gemma 3 / Gemma 2 decoder forward pass of calrt-sim (fp32
 * math; KV fp32 or bf16), with sliding-window attention layers and logit soft-capping for any family.
 *
 * Batch invariance (Invariant): every output element of a linear layer is computed by exactly the
 * same sequence of float operations regardless of how many rows (lanes/tokens) the job has, which
 * lane it is in, which tile shape or CPU code path (matmul.c) covers it, or which worker thread
 * computes it: an 8-wide vector accumulator over k in steps of 8 (fused multiply-adds, matmul.c), a
 * fixed horizontal sum, then the scalar tail. Tiles, row blocks and the chunks of output rows handed
 * to the pool's threads (pool.c) only decide which (output, row) pairs share a loaded weight vector
 * and who computes them, never the summation order. Norms, RoPE and attention are per row (attention tasks are one (row, head) each).
 * Hence a lane's logits are bitwise independent of B, its lane index, its batch-mates and the thread
 * count. Built with -ffp-contract=off so the compiler fuses nothing on its own (the linear layers'
 * multiply-adds are fused explicitly, on every path alike; attention's are not fused at all).
 * SiLU's and the softmax's expf run 8 at a time (vexp.c): elementwise, bitwise glibc's expf; Gemma's
 * GELU is elementwise too (in double, as the reference computes it). A sliding layer's row attends to
 * the positions of its own window, a function of its position alone: still per row. Soft-capping
 * (Gemma 2's attention scores and final logits) is elementwise: libm's tanhf, one scalar call per
 * element from one compiled copy of softcap() on every path.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Attention's q . k: the linear layers' lanes and tree (matmul.c) on v8f, each product rounded then
 * added (not fused: attention streams KV from memory, fused it would be no faster). */
#include "v8f.h"

/* Several independent matmuls (e.g. q, k and v of one layer) as one parallel region: each task is a
 * chunk of one matmul's output rows. */
typedef struct mm_op {
  const float *W;
  int out, in;
  const float *X;
  int R;
  float *Y;
  int chunk, first_task; /* outputs per task (a multiple of 24), index of its first task */
} mm_op;

typedef struct mm_region {
  mm_op op[3];
  int n_ops;
  int glu; /* op[0] gate, op[1] up (same shape): a task computes both chunks, then gate = silu(gate) * up */
  int gelu; /* with glu: gate = gelu_tanh(gate) * up instead (Gemma 3, 2) */
  sim_isa_id isa;
} mm_region;

/* g = gelu_tanh(g) * u elementwise, where gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 * (Gemma's "gelu_pytorch_tanh"), computed in double and rounded to float once, as reference.py does
 * (its float64 GELU, then a float32 product): per element, so the bits depend on nothing else. */
static void gelu_tanh_mul(float *restrict g, const float *restrict u, int n) {
  const double c = sqrt(2.0 / M_PI);
  for (int i = 0; i < n; i++) {
    const double x = (double)g[i];
    g[i] = (float)(0.5 * x * (1.0 + tanh(c * (x + 0.044715 * (x * x * x))))) * u[i];
  }
}

/* x[i] = c * tanhf(x[i] / c) for i < n (logit soft-capping, c > 0): per element, a float division,
 * libm's tanhf and a float product, so an element's bits depend on its value alone. Not inlined: the
 * attention paths (default / avx2 / avx512 builds of attn_body) and the logits all call this one copy. */
static __attribute__((noinline)) void softcap(float *x, int n, float c) {
  for (int i = 0; i < n; i++) x[i] = c * tanhf(x[i] / c);
}

static void mm_task(void *ctx, int task, int worker) {
  (void)worker;
  const mm_region *g = ctx;
  if (g->glu) {
    const mm_op *ga = &g->op[0], *up = &g->op[1];
    const int o0 = task * ga->chunk, o1 = o0 + ga->chunk < ga->out ? o0 + ga->chunk : ga->out;
    sim_matmul_range_isa(g->isa, ga->W, ga->out, ga->in, ga->X, ga->R, ga->Y, o0, o1);
    sim_matmul_range_isa(g->isa, up->W, up->out, up->in, up->X, up->R, up->Y, o0, o1);
    /* gate = (gate / (1 + expf(-gate))) * up, elementwise; expf 8 at a time (vexp.c, same bits). Gemma:
     * gate = gelu_tanh(gate) * up, elementwise. */
    for (int r = 0; r < ga->R; r++) {
      float *gr = ga->Y + (size_t)r * ga->out + o0;
      const float *ur = up->Y + (size_t)r * up->out + o0;
      if (g->gelu) gelu_tanh_mul(gr, ur, o1 - o0);
      else sim_silu_mul(gr, ur, o1 - o0);
    }
    return;
  }
  int i = g->n_ops - 1;
  while (i > 0 && task < g->op[i].first_task) i--;
  const mm_op *op = &g->op[i];
  const int o0 = (task - op->first_task) * op->chunk;
  const int o1 = o0 + op->chunk < op->out ? o0 + op->chunk : op->out;
  sim_matmul_range_isa(g->isa, op->W, op->out, op->in, op->X, op->R, op->Y, o0, o1);
}

/* Below this many multiply-adds a region runs inline on the engine thread: handing it to the pool
 * would cost more than it saves (a loaded host wakes a helper late). SmolLM2's decode matmuls are all
 * above it; the tiny demo model's jobs stay below it unless the prompt is long. */
#define SIM_PARALLEL_MIN (1LL << 18)

/* Tasks per thread of a parallel matmul (each a chunk of output rows, claimed dynamically). Fewer,
 * larger chunks: SmolLM2 B16, 2 threads, alternated: 8 per thread 349-353 tok/s, 4: 363, 2: 367-377,
 * 1: 372; with one CPU kept busy by another process all were equal (226-243), the dynamic claim
 * keeping the balance. Why finer chunks cost more is not proven: packing avx512z's lanes once per
 * region instead of per task, or prefetching across a chunk's end, did not change it. */
#define SIM_TASKS_PER_THREAD 2

/* Run the region's matmuls on the pool (small regions inline, see SIM_PARALLEL_MIN). */
static void matmuls(sim_pool *pool, mm_region *g) {
  long long work = 0;
  for (int i = 0; i < g->n_ops; i++) work += (long long)g->op[i].out * g->op[i].in * g->op[i].R;
  const int threads = sim_pool_threads(pool);
  g->isa = sim_isa();
  int tasks = 0;
  for (int i = 0; i < g->n_ops; i++) {
    mm_op *op = &g->op[i];
    int want = threads > 1 && work >= SIM_PARALLEL_MIN ? SIM_TASKS_PER_THREAD * threads : 1;
    int chunk = (op->out + want - 1) / want;
    /* Several passes over a chunk's weights (one per block of X rows): keep them in L2. */
    if (op->R > sim_row_block(op->in) && chunk > SIM_CHUNK_FLOATS / op->in) chunk = SIM_CHUNK_FLOATS / op->in;
    chunk = (chunk + 23) / 24 * 24; /* whole tiles of every path (6 or 4 rows) */
    op->chunk = chunk;
    op->first_task = tasks;
    if (!g->glu || i == 0) tasks += (op->out + chunk - 1) / chunk;
  }
  if (g->glu) g->op[1].chunk = g->op[0].chunk;
  if (threads > 1 && work >= SIM_PARALLEL_MIN) sim_pool_run(pool, mm_task, g, tasks);
  else
    for (int t = 0; t < tasks; t++) mm_task(g, t, 0);
}

static void matmul(sim_pool *pool, const float *W, int out, int in, const float *X, int R, float *Y) {
  mm_region g = {.op = {{W, out, in, X, R, Y, 0, 0}}, .n_ops = 1};
  matmuls(pool, &g);
}

static void rmsnorm(const float *x, const float *w, int n, float eps, float *y) {
  double ss = 0;
  for (int i = 0; i < n; i++) ss += (double)x[i] * (double)x[i];
  float r = sqrtf((float)(ss / n) + eps);
  for (int i = 0; i < n; i++) y[i] = (x[i] / r) * w[i];
}

/* rmsnorm() of R rows of n (x row-major, y likewise; not in place), each row by exactly rmsnorm()'s
 * operations. A row's sum of squares is one chain of dependent double adds (~4 cycles each: 0.7 us a
 * row of 576); eight rows' chains side by side keep the adder busy instead (SmolLM2 B16: the norms
 * were 2.2% of a decode step, run by the engine thread alone while the helpers wait). */
#define NORM_ROWS 8
static inline __attribute__((always_inline)) void rmsnorm_rows_body(const float *restrict x,
                                                                   const float *restrict w, int n, float eps,
                                                                   float *restrict y, int R) {
  for (int r0 = 0; r0 < R; r0 += NORM_ROWS) {
    const int nb = R - r0 < NORM_ROWS ? R - r0 : NORM_ROWS;
    const float *xb = x + (size_t)r0 * n;
    if (nb < NORM_ROWS) {
      for (int j = 0; j < nb; j++) rmsnorm(xb + (size_t)j * n, w, n, eps, y + (size_t)(r0 + j) * n);
      continue;
    }
    double ss[NORM_ROWS] = {0};
    for (int i = 0; i < n; i++)
      for (int j = 0; j < NORM_ROWS; j++) ss[j] += (double)xb[(size_t)j * n + i] * (double)xb[(size_t)j * n + i];
    for (int j = 0; j < NORM_ROWS; j++) {
      const float r = sqrtf((float)(ss[j] / n) + eps);
      const float *xr = xb + (size_t)j * n;
      float *yr = y + (size_t)(r0 + j) * n;
      for (int i = 0; i < n; i++) yr[i] = (xr[i] / r) * w[i];
    }
  }
}

static void rmsnorm_rows_default(const float *x, const float *w, int n, float eps, float *y, int R) {
  rmsnorm_rows_body(x, w, n, eps, y, R);
}
#if defined(__x86_64__) && defined(__GNUC__)
/* The same operations in AVX registers (elementwise: no reordering). */
__attribute__((target("avx2"))) static void rmsnorm_rows_avx2(const float *x, const float *w, int n, float eps,
                                                              float *y, int R) {
  rmsnorm_rows_body(x, w, n, eps, y, R);
}
#endif

static void rmsnorm_rows(const float *x, const float *w, int n, float eps, float *y, int R) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (sim_isa() != SIM_ISA_DEFAULT) {
    rmsnorm_rows_avx2(x, w, n, eps, y, R);
    return;
  }
#endif
  rmsnorm_rows_default(x, w, n, eps, y, R);
}

static inline uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) return (uint16_t)((u >> 16) | 0x40u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static inline float bf16_to_f32(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

static void rope(float *x, int D, const float *cs, const float *sn) {
  int h = D / 2;
  for (int i = 0; i < h; i++) {
    float a = x[i], b = x[i + h];
    x[i] = a * cs[i] - b * sn[i];
    x[i + h] = b * cs[i] + a * sn[i];
  }
}

void sim_null_logits(const calrt_calbin *cb, int32_t token, int32_t position, float *out) {
  uint64_t s = 0x243F6A8885A308D3ULL ^ ((uint64_t)(uint32_t)token << 32) ^ (uint64_t)(uint32_t)position;
  uint64_t x = sim_rng_next(&s);
  for (int32_t v = 0; v < cb->m.vocab_size; v++) {
    x = x * 6364136223846793005ULL + 1442695040888963407ULL;
    out[v] = (float)(int32_t)(x >> 40) * (1.0f / 8388608.0f) - 1.0f;
  }
}

typedef struct row_info {
  int32_t seq, pos, token, out_lane; /* out_lane -1: no logits for this row */
} row_info;

/* q . k over head_dim in the matmuls' fixed 8-lane order, products not fused (per row: batch-invariant). */
static inline __attribute__((always_inline)) float dot(const float *restrict a, const float *restrict b,
                                                      int n) {
  v8f acc = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int n8 = n & ~7;
  for (int i = 0; i < n8; i += 8) acc += ld8(a + i) * ld8(b + i);
  float s = HSUM8(acc);
  for (int i = n8; i < n; i++) s += a[i] * b[i];
  return s;
}

/* Causal attention of one (row, KV head) over its own sequence, positions [0, pos] (a sliding layer's:
 * [pos - window + 1, pos], see win_start), for the `group`
 * query heads that share that KV head (one pass over its K and V rows serves them all): a task of the
 * attention region. Per query head the operations and their order are fixed (attn_body),
 * whatever the grouping, the thread or the code path. Each worker has its own scratch. */
typedef struct attn_region {
  const calrt_calbin *cb;
  const row_info *rows;
  float *q; /* rotated in place by rope_kv */
  float *att;
  float *scratch; /* [threads][group * S + 8 * D] */
  int L, H, KVH, D, S, group, bf16;
  int window; /* layer L's sliding window (0: it attends to every earlier position) */
  float scale;
  float softcap; /* > 0: each score s (after / scale) becomes softcap * tanhf(s / softcap); 0: none */
  sim_isa_id isa;
  /* rope_kv's inputs: layer L's weights (its q/k norms), the rows' k and v, their RoPE tables (of
   * layer L's base) */
  const sim_layer *w;
  float *k;
  const float *v, *cs, *sn;
  int qkn;
  float eps;
  int rope_in_task; /* decode: each task first does its own (row, KV head)'s rope_kv */
  const int *next;  /* [worker]: the task it runs after this one, -1 none (sim_pool_run_ahead) */
  int *pf_task;     /* [worker]: the task whose K rows the worker's previous task prefetched, -1 none */
} attn_region;

/* The first position a row at `pos` attends to in a layer of sliding window `window` (0: none). */
static inline int win_start(int window, int pos) { return window > 0 && pos >= window ? pos - window + 1 : 0; }

/* Row r's RoPE and KV write for KV head kh: the group's query heads and the key head (Qwen3, Gemma 3:
 * each RMS-normed first) rotated in place, then the key and value heads written into the row's sequence's
 * cache at its position. Every head's operations are its own, so any order of (row, head) gives the
 * same bits. */
static void rope_kv(const attn_region *a, int r, int kh) {
  const int D = a->D, G = a->group;
  const float *c_ = a->cs + (size_t)r * (D / 2), *s_ = a->sn + (size_t)r * (D / 2);
  for (int g = 0; g < G; g++) {
    float *qh = a->q + ((size_t)r * a->H + (size_t)kh * G + g) * D;
    if (a->qkn) rmsnorm(qh, a->w->q_norm, D, a->eps, qh);
    rope(qh, D, c_, s_);
  }
  const sim_seq *sq = &a->cb->seqs[a->rows[r].seq];
  float *khp = a->k + ((size_t)r * a->KVH + kh) * D;
  const float *vhp = a->v + ((size_t)r * a->KVH + kh) * D;
  if (a->qkn) rmsnorm(khp, a->w->k_norm, D, a->eps, khp);
  rope(khp, D, c_, s_);
  for (int kv = 0; kv < 2; kv++) {
    const float *src = kv ? vhp : khp;
    const size_t off = ((((size_t)a->L * 2 + kv) * a->KVH + kh) * a->S + (size_t)a->rows[r].pos) * D;
    if (a->bf16) {
      uint16_t *dst = (uint16_t *)sq->kv + off;
      for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(src[d]);
    } else {
      memcpy((float *)sq->kv + off, src, sizeof(float) * D);
    }
  }
}

typedef uint16_t v8u16 __attribute__((vector_size(16)));
typedef uint32_t v8u32 __attribute__((vector_size(32)));

/* Eight KV values from a head's rows (`rows`: its position 0; `at`: element index) as floats (bf16
 * widened exactly); the KV type is a constant of the caller's instantiation (no test per load). */
static inline __attribute__((always_inline)) v8f kvv(const void *rows, size_t at, const int BF16) {
  if (!BF16) return ld8((const float *)rows + at);
  v8u16 h;
  memcpy(&h, (const uint16_t *)rows + at, sizeof h);
  const v8u32 u = __builtin_convertvector(h, v8u32) << 16;
  v8f f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline __attribute__((always_inline)) float kv1(const void *rows, size_t at, const int BF16) {
  return BF16 ? bf16_to_f32(((const uint16_t *)rows)[at]) : ((const float *)rows)[at];
}

/* Position s's row of D values as floats: the row itself (fp32), else widened into buf. */
static inline __attribute__((always_inline)) const float *kv_row(const void *rows, int D, int s, float *buf,
                                                                 const int BF16) {
  if (!BF16) return (const float *)rows + (size_t)s * D;
  const int D8 = D & ~7;
  for (int d = 0; d < D8; d += 8) {
    const v8f w = kvv(rows, (size_t)s * D + (size_t)d, 1);
    memcpy(buf + d, &w, sizeof w);
  }
  for (int d = D8; d < D; d++) buf[d] = kv1(rows, (size_t)s * D + (size_t)d, 1);
  return buf;
}

/* Row r's KV head kh's K (kv 0) or V (kv 1) rows of layer L: position 0 of S, row_bytes each. */
static inline __attribute__((always_inline)) const char *kv_head_rows(const attn_region *a, int r, int kh, int kv,
                                                                      size_t row_bytes) {
  return (const char *)a->cb->seqs[a->rows[r].seq].kv + (((size_t)a->L * 2 + kv) * a->KVH + kh) * a->S * row_bytes;
}

/* Attention streams each (row, KV head)'s K and V from memory once per step (at B16, SmolLM2 reads 30
 * MB of fp32 KV a step at a 40-token context, 760 MB at 1024), a few KiB to a few hundred KiB per
 * task: too short for the hardware prefetchers to learn each stream in time. So a task prefetches
 * into L2 its first PF_TASK_POS positions of K and V when it starts, then, while it scores each block
 * of 8 positions, K's rows PF_K_AHEAD positions on and V's rows PF_V_AHEAD positions on (V is read
 * after the softmax, so by then most of it is in L2). Into L2, not L1: a core tracks more L2 misses
 * than L1 ones, and L1 prefetches of a whole stream only evict each other. SmolLM2 B16 at a 512-token
 * context (2 cores, alternated): 16.3-16.9 ms of attention a step with L1 prefetches 16 positions
 * ahead of the scores and of V's sum loop, 16.6-16.7 with none at all, 14.6-14.9 this way.
 * The outputs' loop reads V from L2 and nothing from memory, so meanwhile it prefetches the K rows of
 * the task its worker runs next (sim_pool_run_ahead), PF_PV_LINES lines per position; that task then
 * skips its own K prefetches. The memory bus stays busy through the whole task instead of only its
 * scores. With the KV in L2 (every task reading one sequence's layer-0 rows, a test build) attention
 * took half the time at 512 tokens: the stream, not the arithmetic, was half of it. SmolLM2 B16 at
 * 1024 tokens, 5 alternated pairs: 22.7-26.8 ms of attention a step (step 51.7-52.9) against
 * 27.5-31.2 (56.5-57.5); 4 lines a position instead of 2 were slower. */
#define PF_TASK_POS 128
#define PF_K_AHEAD 64
#define PF_V_AHEAD 128
#define PF_PV_LINES 2

/* Positions [s0, s1) of a KV head's K or V rows (row bytes each) towards L2. */
static inline __attribute__((always_inline)) void kv_prefetch(const char *rows, size_t row_bytes, int s0,
                                                              int s1) {
  for (const char *p = rows + (size_t)s0 * row_bytes, *e = rows + (size_t)s1 * row_bytes; p < e; p += 64)
    __builtin_prefetch(p, 0, 2);
}

/* The scores of positions s0..s0+7, each exactly dot(q, k_s) / scale (the linear layers' reduction):
 * eight independent accumulator chains side by side instead of one position's chain after the other
 * (a single chain waits on the add latency), then per position the same horizontal sum, tail and
 * division. */
static inline __attribute__((always_inline)) void scores8(const void *K, const int D, float scale,
                                                          const float *qh, int s0, float *sc, const int BF16) {
  const int D8 = D & ~7;
  v8f acc[8];
  for (int t = 0; t < 8; t++) acc[t] = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int d = 0; d < D8; d += 8) {
    const v8f qv = ld8(qh + d);
    for (int t = 0; t < 8; t++) acc[t] += qv * kvv(K, (size_t)(s0 + t) * D + (size_t)d, BF16);
  }
  if (D8 == D) { /* the eight horizontal sums as one vector (hsum8x8: HSUM8's operations), then / scale */
    const v8f x = hsum8x8(acc) / scale;
    memcpy(sc, &x, sizeof x);
    return;
  }
  for (int t = 0; t < 8; t++) {
    float x = HSUM8(acc[t]);
    for (int d = D8; d < D; d++) x += qh[d] * kv1(K, (size_t)(s0 + t) * D + (size_t)d, BF16);
    sc[t] = x / scale;
  }
}

/* The largest of x[0..n) as `for s: if (x[s] > m) m = x[s]` from m = -inf finds it, 8 lanes side by
 * side: each lane keeps the first of its largest values by the same comparison, then the lanes are
 * compared the same way. Exactly that loop's value except for which zero a tie of +0 and -0 keeps,
 * which no caller can see (x - m, then exp: both zeros give exp(+-0) = 1; every other x - m is the
 * same either way). NaNs are skipped either way (no comparison with a NaN is true). */
static inline __attribute__((always_inline)) float max_of(const float *x, int n) {
  const int n8 = n & ~7;
  float m = -INFINITY;
  if (n8) {
    v8f mv = ld8(x);
    for (int s = 8; s < n8; s += 8) {
      const v8f v = ld8(x + s);
      const v8i k = v > mv; /* all ones where v > mv: take v there, else keep mv */
      v8i vi, mi;
      memcpy(&vi, &v, sizeof vi);
      memcpy(&mi, &mv, sizeof mi);
      mi = (k & vi) | (~k & mi);
      memcpy(&mv, &mi, sizeof mv);
    }
    for (int j = 0; j < 8; j++)
      if (mv[j] > m) m = mv[j];
  }
  for (int s = n8; s < n; s++)
    if (x[s] > m) m = x[s];
  return m;
}

/* The outputs of query heads g0..g0+NH-1 (NH <= 3) for dimensions [d0, d0 + 8 * NV): per position s
 * one load of V's 8 * NV values serves every head (each head's accumulators its own: out[d] =
 * (((0 + p_0 v_0[d]) + p_1 v_1[d]) + ...) in order of s, exactly as one head alone). */
static inline __attribute__((always_inline)) const char *pv_block(const void *V, const int D, const float *const *p,
                                                                  float *const *out, int n, int d0, const int NH,
                                                                  const int NV, const int BF16, const char *pf,
                                                                  const char *pfe) {
  v8f acc[3][4];
  for (int g = 0; g < NH; g++)
    for (int i = 0; i < NV; i++) acc[g][i] = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int s = 0; s < n; s++) {
    if (pf < pfe) { /* the next task's K rows towards L2, PF_PV_LINES lines a position */
      for (int j = 0; j < PF_PV_LINES; j++) __builtin_prefetch(pf + 64 * j, 0, 2);
      pf += 64 * PF_PV_LINES;
    }
    for (int i = 0; i < NV; i++) {
      const v8f v = kvv(V, (size_t)s * D + (size_t)(d0 + 8 * i), BF16);
      for (int g = 0; g < NH; g++) acc[g][i] += p[g][s] * v;
    }
  }
  for (int g = 0; g < NH; g++) memcpy(out[g] + d0, acc[g], sizeof(v8f) * (size_t)NV);
  return pf;
}

/* A KV head's G query heads in one pass over its positions: the scores of each block of 8 positions
 * for every head while that block of K is in L1, each head's max, exps and sum (the heads' sums as
 * independent chains side by side, each in order of s), then each V row loaded once for up to three
 * heads at a time. Per head the operations and their order are those of one head alone: scores
 * exactly dot(q, k_s) / scale (then soft-capped, elementwise, when set), max, exp and sum in order of
 * s, p = e / sum, then each output element out[d] = (((0 + p_0 v_0[d]) + p_1 v_1[d]) + ...) in order
 * of s. So the bits do not depend on the group size, the fusion, the thread or the code path. */
static inline __attribute__((always_inline)) void attn_body_t(const attn_region *a, int task, int worker,
                                                              const int BF16, const int DC) {
  const int r = task / a->KVH, kh = task % a->KVH, D = DC ? DC : a->D, S = a->S, G = a->group;
  if (a->rope_in_task) rope_kv(a, r, kh);
  float *sc = a->scratch + (size_t)worker * ((size_t)G * S + 8 * (size_t)D), *kr = sc + (size_t)G * S;
  /* The row's window, positions [w0, pos]: from here on position s of the loops is w0 + s (K's and V's
   * rows start at w0; the positions before it are neither read nor prefetched). */
  const int w0 = win_start(a->window, a->rows[r].pos), n = a->rows[r].pos + 1 - w0, D8 = D & ~7;
  const size_t rowb = (size_t)D * (BF16 ? 2 : 4);
  const char *kb_ = kv_head_rows(a, r, kh, 0, rowb) + (size_t)w0 * rowb;
  const char *vb_ = kv_head_rows(a, r, kh, 1, rowb) + (size_t)w0 * rowb;
  /* K's rows are in L2 already when this worker's previous task prefetched them (all of them) */
  const int k_ready = a->pf_task && a->pf_task[worker] == task;
  if (!k_ready) kv_prefetch(kb_, rowb, 0, n < PF_TASK_POS ? n : PF_TASK_POS);
  kv_prefetch(vb_, rowb, 0, n < PF_TASK_POS ? n : PF_TASK_POS);
  /* The next task's K rows, prefetched while this task's outputs are summed */
  const int nt = a->next ? a->next[worker] : -1;
  const char *pf = NULL, *pfe = NULL;
  if (nt >= 0) { /* that task's own window of K rows */
    const int npos = a->rows[nt / a->KVH].pos, nw0 = win_start(a->window, npos);
    pf = kv_head_rows(a, nt / a->KVH, nt % a->KVH, 0, rowb) + (size_t)nw0 * rowb;
    pfe = pf + (size_t)(npos + 1 - nw0) * rowb;
  }
  const float *qg = a->q + ((size_t)r * a->H + (size_t)kh * G) * D; /* head g: qg + g * D */
  float *ag = a->att + ((size_t)r * a->H + (size_t)kh * G) * D;
  /* Scores: each block of K rows is read from memory once for all G heads (and stays in L1 for them). */
  int s0 = 0;
  for (; s0 + 8 <= n; s0 += 8) {
    const int k1 = s0 + PF_K_AHEAD, v1 = s0 + PF_V_AHEAD;
    if (k1 < n && !k_ready) kv_prefetch(kb_, rowb, k1, k1 + 8 < n ? k1 + 8 : n);
    if (v1 < n) kv_prefetch(vb_, rowb, v1, v1 + 8 < n ? v1 + 8 : n);
    if (BF16 && G > 1) { /* the block's 8 rows widened once (exactly) for all G heads */
      for (int t = 0; t < 8; t++) kv_row(kb_, D, s0 + t, kr + (size_t)t * D, 1);
      for (int g = 0; g < G; g++) scores8(kr, D, a->scale, qg + (size_t)g * D, 0, sc + (size_t)g * S + s0, 0);
    } else {
      for (int g = 0; g < G; g++)
        scores8(kb_, D, a->scale, qg + (size_t)g * D, s0, sc + (size_t)g * S + s0, BF16);
    }
  }
  for (int s = s0; s < n; s++) {
    const float *k = kv_row(kb_, D, s, kr, BF16);
    for (int g = 0; g < G; g++) sc[(size_t)g * S + s] = dot(qg + (size_t)g * D, k, D) / a->scale;
  }
  if (a->softcap > 0) /* soft-capped scores (Gemma 2), elementwise, before the max and the exps */
    for (int g = 0; g < G; g++) softcap(sc + (size_t)g * S, n, a->softcap);
  for (int g = 0; g < G; g++) {
    float *e = sc + (size_t)g * S;
    sim_exp_shift(e, n, max_of(e, n)); /* e[s] = expf(e[s] - mx), 8 at a time (vexp.c, same bits) */
  }
  /* The sums, three heads' chains side by side, then p = e / sum. */
  for (int g0 = 0; g0 < G; g0 += 3) {
    const int nh = G - g0 < 3 ? G - g0 : 3;
    const float *e0 = sc + (size_t)g0 * S, *e1 = nh > 1 ? e0 + S : e0, *e2 = nh > 2 ? e0 + 2 * (size_t)S : e0;
    float u0 = 0.f, u1 = 0.f, u2 = 0.f;
    for (int s = 0; s < n; s++) {
      u0 += e0[s];
      u1 += e1[s];
      u2 += e2[s];
    }
    const float u[3] = {u0, u1, u2};
    for (int g = 0; g < nh; g++) {
      float *e = sc + (size_t)(g0 + g) * S;
      for (int s = 0; s < n; s++) e[s] = e[s] / u[g];
    }
  }
  /* The outputs, up to three heads per pass over V. */
  for (int g0 = 0; g0 < G; g0 += 3) {
    const int nh = G - g0 < 3 ? G - g0 : 3;
    const float *p[3];
    float *out[3];
    for (int g = 0; g < 3; g++) {
      const int gg = g0 + (g < nh ? g : 0);
      p[g] = sc + (size_t)gg * S;
      out[g] = ag + (size_t)gg * D;
    }
    int d0 = 0;
    for (; d0 + 32 <= D8; d0 += 32) switch (nh) {
      case 3: pf = pv_block(vb_, D, p, out, n, d0, 3, 4, BF16, pf, pfe); break;
      case 2: pf = pv_block(vb_, D, p, out, n, d0, 2, 4, BF16, pf, pfe); break;
      default: pf = pv_block(vb_, D, p, out, n, d0, 1, 4, BF16, pf, pfe); break;
      }
    for (; d0 < D8; d0 += 8) switch (nh) {
      case 3: pf = pv_block(vb_, D, p, out, n, d0, 3, 1, BF16, pf, pfe); break;
      case 2: pf = pv_block(vb_, D, p, out, n, d0, 2, 1, BF16, pf, pfe); break;
      default: pf = pv_block(vb_, D, p, out, n, d0, 1, 1, BF16, pf, pfe); break;
      }
    for (int g = 0; g < nh; g++)
      for (int d = D8; d < D; d++) {
        float t = 0.f;
        for (int s = 0; s < n; s++) t += p[g][s] * kv1(vb_, (size_t)s * D + (size_t)d, BF16);
        out[g][d] = t;
      }
  }
  if (a->pf_task) a->pf_task[worker] = nt >= 0 && pf >= pfe ? nt : -1;
}

/* attn_body_t instantiated for the KV type and SmolLM2's / Qwen3's head size (constants: clean loops). */
static inline __attribute__((always_inline)) void attn_body(const attn_region *a, int task, int worker) {
  if (a->bf16) {
    if (a->D == 64) attn_body_t(a, task, worker, 1, 64);
    else attn_body_t(a, task, worker, 1, 0);
  } else {
    if (a->D == 64) attn_body_t(a, task, worker, 0, 64);
    else attn_body_t(a, task, worker, 0, 0);
  }
}

static void attn_default(const attn_region *a, int task, int worker) { attn_body(a, task, worker); }
#if defined(__x86_64__) && defined(__GNUC__)
/* The same operations in AVX registers (elementwise products and sums, v8f dots: no reordering). */
__attribute__((target("avx2"))) static void attn_avx2(const attn_region *a, int task, int worker) {
  attn_body(a, task, worker);
}
/* AVX-512VL's 32 ymm registers: pv_block's 3 heads x 4 vectors of accumulators without spills (the
 * same 256-bit operations). */
__attribute__((target("avx2,avx512f,avx512vl"))) static void attn_avx512(const attn_region *a, int task,
                                                                         int worker) {
  attn_body(a, task, worker);
}
#endif

static void attn_task(void *ctx, int task, int worker) {
  const attn_region *a = ctx;
#if defined(__x86_64__) && defined(__GNUC__)
  if (a->isa == SIM_ISA_AVX512 || a->isa == SIM_ISA_AVX512Z) {
    attn_avx512(a, task, worker);
    return;
  }
  if (a->isa != SIM_ISA_DEFAULT) {
    attn_avx2(a, task, worker);
    return;
  }
#endif
  attn_default(a, task, worker);
}

/* y[r, :] += b for each of the R rows of width n. */
static void add_bias_rows(float *y, const float *b, int n, int R) {
  for (int r = 0; r < R; r++) {
    float *row = y + (size_t)r * (size_t)n;
    for (int i = 0; i < n; i++) row[i] += b[i];
  }
}

/* Whether layer L attends to a sliding window (calrt.h: calrt_model_desc.sliding_window_pattern). */
static int layer_slides(const calrt_model_desc *m, int L) {
  if (m->sliding_window <= 0) return 0;
  return m->sliding_window_pattern == 0 || (L + 1) % m->sliding_window_pattern != 0;
}

/* Rows' RoPE tables of base theta: cs/sn[r * D/2 + i] = cos/sin(pos_r * theta^(-2i/D) / divisor_i
 * / scaling), in double, rounded to float once (scaling 1: none). */
static void rope_tables(const calrt_calbin *cb, const row_info *rows, int R, double theta, double scaling,
                        float *cs, float *sn) {
  const int D = cb->m.head_dim;
  for (int r = 0; r < R; r++)
    for (int i = 0; i < D / 2; i++) {
      double inv = 1.0 / pow(theta, (double)(2 * i) / (double)D);
      if (cb->rope_freqs) inv /= (double)cb->rope_freqs[i];
      if (scaling != 1.0) inv /= scaling;
      double f = (double)rows[r].pos * inv;
      cs[(size_t)r * (D / 2) + i] = (float)cos(f);
      sn[(size_t)r * (D / 2) + i] = (float)sin(f);
    }
}

/* A job's buffers up to this size are kept by the engine's pool for the next job (every decode step
 * and short prefill); a long prefill allocates its own and frees them. */
#define SIM_SCRATCH_KEEP ((size_t)32 << 20)

int sim_forward(calrt_calbin *cb, calrt_job *job, int null_compute, sim_pool *pool) {
  const calrt_model_desc *m = &cb->m;
  const int h = m->hidden_size, H = m->num_attention_heads, KVH = m->num_key_value_heads;
  const int D = m->head_dim, I = m->intermediate_size, V = m->vocab_size, group = H / KVH;
  const int S = cb->p.max_seq, bf16 = cb->p.kv_dtype == CALRT_KV_BF16;
  /* Qwen3, Gemma 3: per-head q/k RMSNorm; Llama, Qwen2, Gemma 2: none */
  const int qkn = m->arch == CALRT_ARCH_QWEN3 || m->arch == CALRT_ARCH_GEMMA3;
  /* Gemma 3 and 2 (Gemma 2: no q/k norm): scaled embedding, sandwich norms, GELU */
  const int gemma = m->arch == CALRT_ARCH_GEMMA3 || m->arch == CALRT_ARCH_GEMMA2;
  /* A second set of RoPE tables when some layer slides with a base of its own that differs from the
   * global layers' (their base, or their linear scaling) */
  int any_slides = 0;
  for (int L = 0; L < m->num_hidden_layers; L++) any_slides |= layer_slides(m, L);
  /* linear RoPE scaling of every layer but sliding ones with their own base (calrt.h) */
  const double scaling = m->rope_scaling_factor > 0 ? (double)m->rope_scaling_factor : 1.0;
  const int local_rope = any_slides && m->rope_local_theta > 0 &&
                         (m->rope_local_theta != m->rope_theta || scaling != 1.0);
  if (null_compute || !cb->has_weights) {
    if (job->kind == JOB_PREFILL && job->all_logits) { /* lane i: token i at its position */
      for (int l = 0; l < job->lanes; l++)
        sim_null_logits(cb, job->tokens[l], job->positions[0] + l, job->logits + (size_t)l * V);
    } else if (job->kind == JOB_PREFILL) {
      if (job->n_tok > 0)
        sim_null_logits(cb, job->tokens[job->n_tok - 1], job->positions[0] + job->n_tok - 1, job->logits);
    } else {
      for (int l = 0; l < job->lanes; l++)
        if (job->valid[l]) sim_null_logits(cb, job->tokens[l], job->positions[l], job->logits + (size_t)l * V);
    }
    return 0;
  }
  /* Every buffer of the pass in one block: the pool's scratch (no allocation per step), or own. */
  const int rows_max = job->kind == JOB_PREFILL ? job->n_tok : job->lanes;
  const size_t Rm = (size_t)(rows_max > 0 ? rows_max : 1), threads = (size_t)sim_pool_threads(pool);
  const size_t n_of[] = {
      (sizeof(row_info) * Rm + 3) / 4, Rm * h, Rm * h, Rm * H * D, Rm * KVH * D, Rm * KVH * D, Rm * H * D, Rm * h,
      Rm * I, Rm * I, Rm * (D / 2), Rm * (D / 2), threads * ((size_t)group * S + 8 * (size_t)D),
      /* lg: the logits of output rows that are not their lanes in order (decode with inactive lanes);
       * a prefill's output rows always are (its one row: lane 0; a prefill-all's row t: lane t), so one
       * row's worth of it, unused (never n_tok rows of vocab floats on top of the job's own buffer) */
      (job->kind == JOB_PREFILL ? 1 : Rm) * V, local_rope ? Rm * (D / 2) : 0, local_rope ? Rm * (D / 2) : 0};
  enum { B_ROWS, B_X, B_HN, B_Q, B_K, B_V, B_ATT, B_O, B_G, B_U, B_CS, B_SN, B_SCRATCH, B_LG, B_CS_LOCAL,
         B_SN_LOCAL, B_N };
  size_t off[B_N + 1];
  off[0] = 0;
  for (int i = 0; i < B_N; i++) off[i + 1] = off[i] + (n_of[i] + 15) / 16 * 16; /* 64-byte aligned */
  const size_t bytes = sizeof(float) * off[B_N];
  float *own = NULL, *base = pool && bytes <= SIM_SCRATCH_KEEP ? sim_pool_scratch(pool, bytes) : NULL;
  if (!base) base = own = aligned_alloc(64, bytes);
  if (!base) return -1;
  row_info *rows = (row_info *)(base + off[B_ROWS]);
  int R = 0;
  if (job->kind == JOB_PREFILL) {
    /* A prefill's logits: of its last row (lane 0); a prefill-all's: of every row t (lane t). */
    R = job->n_tok;
    for (int t = 0; t < R; t++)
      rows[t] = (row_info){job->seq_ids[0], job->positions[0] + t, job->tokens[t],
                           job->all_logits ? t : t == R - 1 ? 0 : -1};
  } else {
    for (int l = 0; l < job->lanes; l++)
      if (job->valid[l]) rows[R++] = (row_info){job->seq_ids[l], job->positions[l], job->tokens[l], l};
  }
  if (R == 0) {
    free(own);
    return 0;
  }
  const size_t R_ = (size_t)R;
  /* CALRT_SIM_PROFILE (profile.c): decode steps' wall time per phase */
  const int prof = job->kind != JOB_PREFILL && sim_prof_enabled();
  double prof_us[SIM_PROF_PHASES] = {0}, prof_t = prof ? sim_now_us() : 0.0;
  const double prof_wait0 = prof ? sim_pool_wait_us(pool) : 0.0;
  const long long prof_regions0 = prof ? sim_pool_regions(pool) : 0;
#define PROF_MARK(ph)                                                                               \
  do {                                                                                              \
    if (prof) {                                                                                     \
      const double t_ = sim_now_us();                                                               \
      prof_us[ph] += t_ - prof_t;                                                                   \
      prof_t = t_;                                                                                  \
    }                                                                                               \
  } while (0)
  float *x = base + off[B_X], *hn = base + off[B_HN], *q = base + off[B_Q], *k = base + off[B_K];
  float *v = base + off[B_V], *att = base + off[B_ATT], *o = base + off[B_O], *g = base + off[B_G];
  float *u = base + off[B_U], *cs = base + off[B_CS], *sn = base + off[B_SN];
  float *scratch = base + off[B_SCRATCH], *lg = base + off[B_LG];
  float *cs_local = local_rope ? base + off[B_CS_LOCAL] : cs, *sn_local = local_rope ? base + off[B_SN_LOCAL] : sn;
  int rc = 0;
  for (int r = 0; r < R; r++) {
    memcpy(x + (size_t)r * h, cb->embed + (size_t)rows[r].token * h, sizeof(float) * h);
    if (gemma) { /* Gemma: the embedding times sqrt(hidden_size), a float multiply per element */
      const float e = sqrtf((float)h);
      for (int i = 0; i < h; i++) x[(size_t)r * h + i] *= e;
    }
  }
  rope_tables(cb, rows, R, m->rope_theta, scaling, cs, sn);
  if (local_rope) rope_tables(cb, rows, R, m->rope_local_theta, 1.0, cs_local, sn_local);
  int distinct = job->kind != JOB_PREFILL;
  for (int r = 0; r < R && distinct; r++)
    for (int r2 = 0; r2 < r; r2++)
      if (rows[r2].seq == rows[r].seq) distinct = 0;
  /* Scores are divided by sqrtf(query_pre_attn_scalar) (Gemma), else by sqrtf(head_dim). */
  const float scale = sqrtf(m->query_pre_attn_scalar > 0 ? m->query_pre_attn_scalar : (float)D);
  attn_region ar = {cb, rows, q, att, scratch, 0, H, KVH, D, S, group, bf16, 0, scale,
                    m->attn_logit_softcapping, sim_isa(), NULL, k, v, cs, sn, qkn, m->rms_norm_eps, distinct,
                    NULL, NULL};
  int attn_next[SIM_POOL_MAX], attn_pf[SIM_POOL_MAX];
  ar.next = attn_next;
  ar.pf_task = attn_pf;
  /* multiply-adds of one layer's attention, global and sliding: small ones run inline */
  long long attn_work = 0, attn_work_local = 0;
  for (int r = 0; r < R; r++) {
    attn_work += 2LL * (rows[r].pos + 1) * H * D;
    attn_work_local += 2LL * (rows[r].pos + 1 - win_start(m->sliding_window, rows[r].pos)) * H * D;
  }
  for (int L = 0; L < m->num_hidden_layers; L++) {
    const sim_layer *w = &cb->layers[L];
    const int slides = layer_slides(m, L);
    rmsnorm_rows(x, w->in_norm, h, m->rms_norm_eps, hn, R);
    PROF_MARK(SIM_PROF_NORMS);
    mm_region qkv = {.op = {{w->q, H * D, h, hn, R, q, 0, 0}, {w->k, KVH * D, h, hn, R, k, 0, 0},
                            {w->v, KVH * D, h, hn, R, v, 0, 0}},
                     .n_ops = 3};
    matmuls(pool, &qkv);
    if (w->q_bias) { /* Qwen2: the projections' biases, before RoPE (each row alone: B-invariant) */
      add_bias_rows(q, w->q_bias, H * D, R);
      add_bias_rows(k, w->k_bias, KVH * D, R);
      add_bias_rows(v, w->v_bias, KVH * D, R);
    }
    PROF_MARK(SIM_PROF_QKV);
    /* q/k norm (Qwen3) + RoPE, then write K/V of every row into its sequence's cache: inside each
     * attention task when every row is its own sequence (decode: no row reads another's KV), else
     * here for all rows first (a prefill row reads earlier rows'). */
    ar.L = L;
    ar.w = w;
    ar.window = slides ? m->sliding_window : 0;
    ar.cs = slides ? cs_local : cs;
    ar.sn = slides ? sn_local : sn;
    if (!ar.rope_in_task)
      for (int r = 0; r < R; r++)
        for (int kh = 0; kh < KVH; kh++) rope_kv(&ar, r, kh);
    PROF_MARK(SIM_PROF_ROPE_KV);
    for (int t = 0; t < SIM_POOL_MAX; t++) attn_pf[t] = -1;
    sim_pool_run_ahead((slides ? attn_work_local : attn_work) >= SIM_PARALLEL_MIN ? pool : NULL, attn_task, &ar,
                       R * KVH, attn_next);
    PROF_MARK(SIM_PROF_ATTN);
    matmul(pool, w->o, h, H * D, att, R, o);
    if (gemma) { /* Gemma: the attention's output RMS-normed before the residual add (hn is free here) */
      rmsnorm_rows(o, w->attn_out_norm, h, m->rms_norm_eps, hn, R);
      for (size_t i = 0; i < R_ * h; i++) x[i] += hn[i];
    } else {
      for (size_t i = 0; i < R_ * h; i++) x[i] += o[i];
    }
    PROF_MARK(SIM_PROF_O);
    rmsnorm_rows(x, w->post_norm, h, m->rms_norm_eps, hn, R); /* the MLP's input norm */
    PROF_MARK(SIM_PROF_NORMS);
    mm_region gu = {.op = {{w->gate, I, h, hn, R, g, 0, 0}, {w->up, I, h, hn, R, u, 0, 0}}, .n_ops = 2,
                    .glu = 1, .gelu = gemma};
    matmuls(pool, &gu); /* g = silu(gate) * up (Gemma: gelu_tanh(gate) * up) */
    PROF_MARK(SIM_PROF_GATE_UP);
    matmul(pool, w->down, h, I, g, R, o);
    if (gemma) { /* Gemma: the MLP's output RMS-normed before the residual add */
      rmsnorm_rows(o, w->ffn_out_norm, h, m->rms_norm_eps, hn, R);
      for (size_t i = 0; i < R_ * h; i++) x[i] += hn[i];
    } else {
      for (size_t i = 0; i < R_ * h; i++) x[i] += o[i];
    }
    PROF_MARK(SIM_PROF_DOWN);
    if (atomic_load(&job->abort)) {
      rc = 1;
      goto out;
    }
  }
  /* Final norm + lm_head only for rows that return logits (prefill: the last token; prefill-all: every
   * token, row t into lane t). A row's logits are bitwise the same whichever other rows run with it
   * (the Invariant above: the norm and the lm_head matmul are per row), so a prefill-all's lane i
   * equals the one lane of a prefill of tokens[0..i]: their rows 0..i compute the same hidden states,
   * since attention is causal (row i reads KV positions <= its own, all written by rows 0..i). */
  {
    int n_out = 0, in_place = 1; /* in_place: output row i is lane i (decode with every lane valid, a prefill,
                                  * a prefill-all) */
    for (int r = 0; r < R; r++)
      if (rows[r].out_lane >= 0) {
        if (n_out < r) memcpy(x + (size_t)n_out * h, x + (size_t)r * h, sizeof(float) * h);
        rows[n_out].out_lane = rows[r].out_lane;
        in_place &= rows[n_out].out_lane == n_out;
        n_out++;
      }
    rmsnorm_rows(x, cb->final_norm, h, m->rms_norm_eps, hn, n_out);
    PROF_MARK(SIM_PROF_NORMS);
    /* The logits straight into the job's buffer when its rows are the lanes in order (no 3 MB copy at
     * B16 on SmolLM2's vocabulary), else row by row into the lanes they belong to. */
    matmul(pool, cb->lm_head, V, h, hn, n_out, in_place ? job->logits : lg);
    if (!in_place)
      for (int r = 0; r < n_out; r++)
        memcpy(job->logits + (size_t)rows[r].out_lane * V, lg + (size_t)r * V, sizeof(float) * V);
    if (m->final_logit_softcapping > 0) /* soft-capped logits (Gemma 2), elementwise */
      for (int r = 0; r < n_out; r++)
        softcap(job->logits + (size_t)rows[r].out_lane * V, V, m->final_logit_softcapping);
    PROF_MARK(SIM_PROF_LM_HEAD);
    if (prof)
      sim_prof_add(R, prof_us, sim_pool_wait_us(pool) - prof_wait0, sim_pool_regions(pool) - prof_regions0);
  }
out:
#undef PROF_MARK
  free(own);
  return rc;
}
