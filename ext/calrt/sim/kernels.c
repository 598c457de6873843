/* kernels.c — the Qwen3 / Llama decoder forward pass of calrt-sim (fp32 math; KV fp32 or bf16).
 *
 * Batch invariance (Invariant): every output element of a linear layer is computed by exactly the
 * same sequence of float operations regardless of how many rows (lanes/tokens) the job has, which
 * lane it is in, which tile shape covers it, or which worker thread computes it: an 8-wide vector
 * accumulator over k in steps of 8, a fixed horizontal sum, then the scalar tail. Tiles, row blocks and
 * the chunks of output rows handed to the pool's threads (pool.c) only decide which (output, row)
 * pairs share a loaded weight vector and who computes them, never the summation order. Norms, RoPE and
 * attention are per row (attention tasks are one (row, head) each). Hence a lane's logits are bitwise
 * independent of B, its lane index, its batch-mates and the thread count. Built with -ffp-contract=off
 * so no FMA contraction can differ between tile shapes.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* v8f values only pass between static inline functions of this file: no ABI is exposed. */
#pragma GCC diagnostic ignored "-Wpsabi"

/* The one reduction every linear-layer output element uses, whatever the tile, chunk, batch or thread:
 * eight lane accumulators over k in steps of 8 (lane j sums k = j, j+8, ... in order), the fixed tree
 * ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7)), then the scalar tail k8..in-1 in order. GCC lowers v8f to
 * two SSE registers on a baseline x86-64 and to one AVX register in the avx2 clone: the same IEEE
 * operations per lane either way (no FMA: -ffp-contract=off, and the avx2 clone does not enable it). */
typedef float v8f __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) v8f ld8(const float *p) {
  v8f v;
  memcpy(&v, p, sizeof v);
  return v;
}

#define hsum8(a) ((((a)[0] + (a)[4]) + ((a)[2] + (a)[6])) + (((a)[1] + (a)[5]) + ((a)[3] + (a)[7])))

static inline __attribute__((always_inline)) void tile(const float *restrict W, const float *restrict X,
                                                       float *restrict Y, int in, int out, int o0, int r0,
                                                       const int RO, const int RL) {
  v8f acc[4][2];
  for (int i = 0; i < RO; i++)
    for (int j = 0; j < RL; j++) acc[i][j] = (v8f){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int k8 = in & ~7;
  for (int k = 0; k < k8; k += 8) {
    v8f xv[2];
    for (int j = 0; j < RL; j++) xv[j] = ld8(X + (size_t)(r0 + j) * in + k);
    for (int i = 0; i < RO; i++) {
      v8f w = ld8(W + (size_t)(o0 + i) * in + k);
      for (int j = 0; j < RL; j++) acc[i][j] += w * xv[j];
    }
  }
  for (int i = 0; i < RO; i++)
    for (int j = 0; j < RL; j++) {
      float s = hsum8(acc[i][j]);
      for (int k = k8; k < in; k++) s += W[(size_t)(o0 + i) * in + k] * X[(size_t)(r0 + j) * in + k];
      Y[(size_t)(r0 + j) * out + o0 + i] = s;
    }
}

#define ROW_BLOCK 4 /* rows of X kept in L1 while a task's weight rows (L2-sized) stream past them */
#define CHUNK_FLOATS 32768 /* a task's weight rows: at most ~128 KiB, so they stay in L2 across row blocks */

/* An AVX2 clone beside the baseline one, picked at load time (an ifunc). Not under ThreadSanitizer,
 * whose runtime is not initialised yet when ifunc resolvers run. */
#if defined(__x86_64__) && !defined(__SANITIZE_THREAD__)
#define SIM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SIM_CLONES
#endif

/* Y[r, o] = sum_k W[o, k] * X[r, k] for o in [o0, o1), every row. Within a row block, each group of
 * 4 weight rows is loaded once for all the block's rows. */
SIM_CLONES static void matmul_range(const float *W, int out, int in,
                                                                          const float *X, int R, float *Y,
                                                                          int o0, int o1) {
  for (int rb = 0; rb < R; rb += ROW_BLOCK) {
    const int re = rb + ROW_BLOCK < R ? rb + ROW_BLOCK : R;
    int o = o0;
    for (; o + 4 <= o1; o += 4) {
      int r = rb;
      for (; r + 2 <= re; r += 2) tile(W, X, Y, in, out, o, r, 4, 2);
      for (; r < re; r++) tile(W, X, Y, in, out, o, r, 4, 1);
    }
    for (; o < o1; o++)
      for (int r = rb; r < re; r++) tile(W, X, Y, in, out, o, r, 1, 1);
  }
}

/* Several independent matmuls (e.g. q, k and v of one layer) as one parallel region: each task is a
 * chunk of one matmul's output rows. */
typedef struct mm_op {
  const float *W;
  int out, in;
  const float *X;
  int R;
  float *Y;
  int chunk, first_task; /* outputs per task (a multiple of 4), index of its first task */
} mm_op;

typedef struct mm_region {
  mm_op op[3];
  int n_ops;
} mm_region;

static void mm_task(void *ctx, int task, int worker) {
  (void)worker;
  const mm_region *g = ctx;
  int i = g->n_ops - 1;
  while (i > 0 && task < g->op[i].first_task) i--;
  const mm_op *op = &g->op[i];
  const int o0 = (task - op->first_task) * op->chunk;
  const int o1 = o0 + op->chunk < op->out ? o0 + op->chunk : op->out;
  matmul_range(op->W, op->out, op->in, op->X, op->R, op->Y, o0, o1);
}

/* Below this many multiply-adds a region runs inline on the engine thread: handing it to the pool
 * would cost more than it saves (a loaded host wakes a helper late). SmolLM2's decode matmuls are all
 * above it; the tiny demo model's jobs stay below it unless the prompt is long. */
#define SIM_PARALLEL_MIN (1LL << 18)

/* Run the region's matmuls on the pool (small regions inline, see SIM_PARALLEL_MIN). */
static void matmuls(sim_pool *pool, mm_region *g) {
  long long work = 0;
  for (int i = 0; i < g->n_ops; i++) work += (long long)g->op[i].out * g->op[i].in * g->op[i].R;
  const int threads = sim_pool_threads(pool);
  int tasks = 0;
  for (int i = 0; i < g->n_ops; i++) {
    mm_op *op = &g->op[i];
    int want = threads > 1 && work >= SIM_PARALLEL_MIN ? 8 * threads : 1;
    int chunk = (op->out + want - 1) / want;
    if (op->R > ROW_BLOCK && chunk > CHUNK_FLOATS / op->in) chunk = CHUNK_FLOATS / op->in;
    chunk = (chunk + 3) & ~3;
    if (chunk < 4) chunk = 4;
    op->chunk = chunk;
    op->first_task = tasks;
    tasks += (op->out + chunk - 1) / chunk;
  }
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

/* q . k over head_dim with the same fixed 8-lane order as the matmuls (per row: batch-invariant). */
static inline float dot(const float *restrict a, const float *restrict b, int n) {
  v8f acc = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  const int n8 = n & ~7;
  for (int i = 0; i < n8; i += 8) acc += ld8(a + i) * ld8(b + i);
  float s = hsum8(acc);
  for (int i = n8; i < n; i++) s += a[i] * b[i];
  return s;
}

/* Causal attention of one (row, head) over its own sequence, positions [0, pos]: a task of the
 * attention region. Each worker has its own score and K-row scratch. */
typedef struct attn_region {
  const calrt_calbin *cb;
  const row_info *rows;
  const float *q;
  float *att;
  float *scratch; /* [threads][S + D] */
  int L, H, KVH, D, S, group, bf16;
  float scale;
} attn_region;

static void attn_task(void *ctx, int task, int worker) {
  const attn_region *a = ctx;
  const int r = task / a->H, hh = task % a->H, D = a->D, S = a->S;
  float *sc = a->scratch + (size_t)worker * (size_t)(S + D), *kr = sc + S;
  const sim_seq *sq = &a->cb->seqs[a->rows[r].seq];
  const int n = a->rows[r].pos + 1, kh = hh / a->group;
  const float *qh = a->q + ((size_t)r * a->H + hh) * D;
  const size_t kbase = (((size_t)a->L * 2 + 0) * a->KVH + kh) * S * D;
  const size_t vbase = (((size_t)a->L * 2 + 1) * a->KVH + kh) * S * D;
  float mx = -INFINITY;
  for (int s = 0; s < n; s++) {
    const float *ks;
    if (a->bf16) {
      const uint16_t *kb = (const uint16_t *)sq->kv + kbase + (size_t)s * D;
      for (int d = 0; d < D; d++) kr[d] = bf16_to_f32(kb[d]);
      ks = kr;
    } else {
      ks = (const float *)sq->kv + kbase + (size_t)s * D;
    }
    sc[s] = dot(qh, ks, D) / a->scale;
    if (sc[s] > mx) mx = sc[s];
  }
  float sum = 0.f;
  for (int s = 0; s < n; s++) {
    sc[s] = expf(sc[s] - mx);
    sum += sc[s];
  }
  float *ah = a->att + ((size_t)r * a->H + hh) * D;
  for (int d = 0; d < D; d++) ah[d] = 0.f;
  for (int s = 0; s < n; s++) {
    const float p = sc[s] / sum;
    if (a->bf16) {
      const uint16_t *vb = (const uint16_t *)sq->kv + vbase + (size_t)s * D;
      for (int d = 0; d < D; d++) ah[d] += p * bf16_to_f32(vb[d]);
    } else {
      const float *vs = (const float *)sq->kv + vbase + (size_t)s * D;
      for (int d = 0; d < D; d++) ah[d] += p * vs[d];
    }
  }
}

int sim_forward(calrt_calbin *cb, calrt_job *job, int null_compute, sim_pool *pool) {
  const calrt_model_desc *m = &cb->m;
  const int h = m->hidden_size, H = m->num_attention_heads, KVH = m->num_key_value_heads;
  const int D = m->head_dim, I = m->intermediate_size, V = m->vocab_size, group = H / KVH;
  const int S = cb->p.max_seq, bf16 = cb->p.kv_dtype == CALRT_KV_BF16;
  const int qkn = m->arch != CALRT_ARCH_LLAMA; /* Qwen3: per-head q/k RMSNorm; Llama: none */
  int R = 0;
  row_info *rows;
  if (job->kind == JOB_PREFILL) {
    R = job->n_tok;
    rows = malloc(sizeof *rows * (size_t)R);
    if (!rows) return -1;
    for (int t = 0; t < R; t++)
      rows[t] = (row_info){job->seq_ids[0], job->positions[0] + t, job->tokens[t], t == R - 1 ? 0 : -1};
  } else {
    rows = malloc(sizeof *rows * (size_t)job->lanes);
    if (!rows) return -1;
    for (int l = 0; l < job->lanes; l++)
      if (job->valid[l]) rows[R++] = (row_info){job->seq_ids[l], job->positions[l], job->tokens[l], l};
  }
  if (null_compute || !cb->has_weights) {
    for (int r = 0; r < R; r++)
      if (rows[r].out_lane >= 0)
        sim_null_logits(cb, rows[r].token, rows[r].pos, job->logits + (size_t)rows[r].out_lane * V);
    free(rows);
    return 0;
  }
  if (R == 0) {
    free(rows);
    return 0;
  }
  const size_t R_ = (size_t)R, threads = (size_t)sim_pool_threads(pool);
  float *x = malloc(sizeof(float) * R_ * h), *hn = malloc(sizeof(float) * R_ * h);
  float *q = malloc(sizeof(float) * R_ * H * D), *k = malloc(sizeof(float) * R_ * KVH * D);
  float *v = malloc(sizeof(float) * R_ * KVH * D), *att = malloc(sizeof(float) * R_ * H * D);
  float *o = malloc(sizeof(float) * R_ * h), *g = malloc(sizeof(float) * R_ * I);
  float *u = malloc(sizeof(float) * R_ * I);
  float *cs = malloc(sizeof(float) * R_ * (D / 2)), *sn = malloc(sizeof(float) * R_ * (D / 2));
  float *scratch = malloc(sizeof(float) * threads * ((size_t)S + (size_t)D));
  float *lg = NULL;
  int rc = 0;
  if (!x || !hn || !q || !k || !v || !att || !o || !g || !u || !cs || !sn || !scratch) {
    rc = -1;
    goto out;
  }
  for (int r = 0; r < R; r++) {
    memcpy(x + (size_t)r * h, cb->embed + (size_t)rows[r].token * h, sizeof(float) * h);
    for (int i = 0; i < D / 2; i++) {
      double inv = 1.0 / pow(m->rope_theta, (double)(2 * i) / (double)D);
      double f = (double)rows[r].pos * inv;
      cs[(size_t)r * (D / 2) + i] = (float)cos(f);
      sn[(size_t)r * (D / 2) + i] = (float)sin(f);
    }
  }
  attn_region ar = {cb, rows, q, att, scratch, 0, H, KVH, D, S, group, bf16, sqrtf((float)D)};
  long long attn_work = 0; /* multiply-adds of one layer's attention: small ones run inline */
  for (int r = 0; r < R; r++) attn_work += 2LL * (rows[r].pos + 1) * H * D;
  for (int L = 0; L < m->num_hidden_layers; L++) {
    const sim_layer *w = &cb->layers[L];
    for (int r = 0; r < R; r++) rmsnorm(x + (size_t)r * h, w->in_norm, h, m->rms_norm_eps, hn + (size_t)r * h);
    mm_region qkv = {.op = {{w->q, H * D, h, hn, R, q, 0, 0}, {w->k, KVH * D, h, hn, R, k, 0, 0},
                            {w->v, KVH * D, h, hn, R, v, 0, 0}},
                     .n_ops = 3};
    matmuls(pool, &qkv);
    /* q/k norm (Qwen3) + RoPE, then write K/V of every row into its sequence's cache. */
    for (int r = 0; r < R; r++) {
      const float *c_ = cs + (size_t)r * (D / 2), *s_ = sn + (size_t)r * (D / 2);
      for (int hh = 0; hh < H; hh++) {
        float *qh = q + ((size_t)r * H + hh) * D;
        if (qkn) rmsnorm(qh, w->q_norm, D, m->rms_norm_eps, qh);
        rope(qh, D, c_, s_);
      }
      sim_seq *sq = &cb->seqs[rows[r].seq];
      for (int kh = 0; kh < KVH; kh++) {
        float *khp = k + ((size_t)r * KVH + kh) * D, *vhp = v + ((size_t)r * KVH + kh) * D;
        if (qkn) rmsnorm(khp, w->k_norm, D, m->rms_norm_eps, khp);
        rope(khp, D, c_, s_);
        for (int kv = 0; kv < 2; kv++) {
          const float *src = kv ? vhp : khp;
          size_t off = ((((size_t)L * 2 + kv) * KVH + kh) * S + (size_t)rows[r].pos) * D;
          if (bf16) {
            uint16_t *dst = (uint16_t *)sq->kv + off;
            for (int d = 0; d < D; d++) dst[d] = f32_to_bf16(src[d]);
          } else {
            memcpy((float *)sq->kv + off, src, sizeof(float) * D);
          }
        }
      }
    }
    /* Every row's K/V is in the cache before any row attends (a prefill row reads earlier rows'). */
    ar.L = L;
    sim_pool_run(attn_work >= SIM_PARALLEL_MIN ? pool : NULL, attn_task, &ar, R * H);
    matmul(pool, w->o, h, H * D, att, R, o);
    for (size_t i = 0; i < R_ * h; i++) x[i] += o[i];
    for (int r = 0; r < R; r++) rmsnorm(x + (size_t)r * h, w->post_norm, h, m->rms_norm_eps, hn + (size_t)r * h);
    mm_region gu = {.op = {{w->gate, I, h, hn, R, g, 0, 0}, {w->up, I, h, hn, R, u, 0, 0}}, .n_ops = 2};
    matmuls(pool, &gu);
    for (size_t i = 0; i < R_ * I; i++) g[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    matmul(pool, w->down, h, I, g, R, o);
    for (size_t i = 0; i < R_ * h; i++) x[i] += o[i];
    if (atomic_load(&job->abort)) {
      rc = 1;
      goto out;
    }
  }
  /* Final norm + lm_head only for rows that return logits (prefill: the last token). */
  {
    int n_out = 0;
    for (int r = 0; r < R; r++)
      if (rows[r].out_lane >= 0) {
        rmsnorm(x + (size_t)r * h, cb->final_norm, h, m->rms_norm_eps, hn + (size_t)n_out * h);
        rows[n_out].out_lane = rows[r].out_lane;
        n_out++;
      }
    lg = malloc(sizeof(float) * (size_t)n_out * V);
    if (!lg) {
      rc = -1;
      goto out;
    }
    matmul(pool, cb->lm_head, V, h, hn, n_out, lg);
    for (int r = 0; r < n_out; r++)
      memcpy(job->logits + (size_t)rows[r].out_lane * V, lg + (size_t)r * V, sizeof(float) * V);
  }
out:
  free(x); free(hn); free(q); free(k); free(v); free(att); free(o); free(g); free(u);
  free(cs); free(sn); free(scratch); free(lg); free(rows);
  return rc;
}
