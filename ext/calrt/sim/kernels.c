/* kernels.c — the Qwen3 decoder forward pass of calrt-sim (fp32 math; KV fp32 or bf16).
 *
 * Batch invariance (Invariant): every output element of a linear layer is computed by exactly the
 * same sequence of float operations regardless of how many rows (lanes/tokens) the job has, which
 * lane it is in, or which tile shape covers it: a 4-wide vector accumulator over k in steps of 4, a
 * fixed horizontal sum, then the scalar tail. Tiles only decide which (output, row) pairs share a loaded
 * weight vector, never the summation order. Norms, RoPE and attention are per row. Hence a lane's
 * logits are bitwise independent of B, its lane index and its batch-mates. Built with
 * -ffp-contract=off so no FMA contraction can differ between tile shapes.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

typedef float v4f __attribute__((vector_size(16)));

static inline v4f ld4(const float *p) {
  v4f v;
  memcpy(&v, p, sizeof v);
  return v;
}

static inline float hsum4(v4f a) { return (a[0] + a[2]) + (a[1] + a[3]); }

static inline __attribute__((always_inline)) void tile(const float *restrict W, const float *restrict X,
                                                       float *restrict Y, int in, int out, int o0, int r0,
                                                       const int RO, const int RL) {
  v4f acc[4][2];
  for (int i = 0; i < RO; i++)
    for (int j = 0; j < RL; j++) acc[i][j] = (v4f){0.f, 0.f, 0.f, 0.f};
  const int k4 = in & ~3;
  for (int k = 0; k < k4; k += 4) {
    v4f xv[2];
    for (int j = 0; j < RL; j++) xv[j] = ld4(X + (size_t)(r0 + j) * in + k);
    for (int i = 0; i < RO; i++) {
      v4f w = ld4(W + (size_t)(o0 + i) * in + k);
      for (int j = 0; j < RL; j++) acc[i][j] += w * xv[j];
    }
  }
  for (int i = 0; i < RO; i++)
    for (int j = 0; j < RL; j++) {
      float s = hsum4(acc[i][j]);
      for (int k = k4; k < in; k++) s += W[(size_t)(o0 + i) * in + k] * X[(size_t)(r0 + j) * in + k];
      Y[(size_t)(r0 + j) * out + o0 + i] = s;
    }
}

/* Y[r, o] = sum_k W[o, k] * X[r, k] for R rows: W (out x in, row-major) is streamed once for all rows. */
static void matmul(const float *W, int out, int in, const float *X, int R, float *Y) {
  int o = 0;
  for (; o + 4 <= out; o += 4) {
    int r = 0;
    for (; r + 2 <= R; r += 2) tile(W, X, Y, in, out, o, r, 4, 2);
    for (; r < R; r++) tile(W, X, Y, in, out, o, r, 4, 1);
  }
  for (; o < out; o++)
    for (int r = 0; r < R; r++) tile(W, X, Y, in, out, o, r, 1, 1);
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

int sim_forward(calrt_calbin *cb, calrt_job *job, int null_compute) {
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
  const size_t R_ = (size_t)R;
  float *x = malloc(sizeof(float) * R_ * h), *hn = malloc(sizeof(float) * R_ * h);
  float *q = malloc(sizeof(float) * R_ * H * D), *k = malloc(sizeof(float) * R_ * KVH * D);
  float *v = malloc(sizeof(float) * R_ * KVH * D), *att = malloc(sizeof(float) * R_ * H * D);
  float *o = malloc(sizeof(float) * R_ * h), *g = malloc(sizeof(float) * R_ * I);
  float *u = malloc(sizeof(float) * R_ * I);
  float *cs = malloc(sizeof(float) * R_ * (D / 2)), *sn = malloc(sizeof(float) * R_ * (D / 2));
  float *sc = malloc(sizeof(float) * (size_t)S), *kr = malloc(sizeof(float) * (size_t)D);
  int rc = 0;
  if (!x || !hn || !q || !k || !v || !att || !o || !g || !u || !cs || !sn || !sc || !kr) {
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
  const float scale = sqrtf((float)D);
  const size_t es = bf16 ? 2 : 4;
  for (int L = 0; L < m->num_hidden_layers; L++) {
    const sim_layer *w = &cb->layers[L];
    for (int r = 0; r < R; r++) rmsnorm(x + (size_t)r * h, w->in_norm, h, m->rms_norm_eps, hn + (size_t)r * h);
    matmul(w->q, H * D, h, hn, R, q);
    matmul(w->k, KVH * D, h, hn, R, k);
    matmul(w->v, KVH * D, h, hn, R, v);
    /* q/k norm + RoPE, then write K/V of every row into its sequence's cache. */
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
    /* Causal attention of each row over its own sequence, positions [0, pos]. */
    for (int r = 0; r < R; r++) {
      const sim_seq *sq = &cb->seqs[rows[r].seq];
      const int n = rows[r].pos + 1;
      for (int hh = 0; hh < H; hh++) {
        const int kh = hh / group;
        const float *qh = q + ((size_t)r * H + hh) * D;
        const size_t kbase = (((size_t)L * 2 + 0) * KVH + kh) * S * D;
        const size_t vbase = (((size_t)L * 2 + 1) * KVH + kh) * S * D;
        float mx = -INFINITY;
        for (int s = 0; s < n; s++) {
          const float *ks;
          if (bf16) {
            const uint16_t *kb = (const uint16_t *)sq->kv + kbase + (size_t)s * D;
            for (int d = 0; d < D; d++) kr[d] = bf16_to_f32(kb[d]);
            ks = kr;
          } else {
            ks = (const float *)sq->kv + kbase + (size_t)s * D;
          }
          float dot = 0.f;
          for (int d = 0; d < D; d++) dot += qh[d] * ks[d];
          sc[s] = dot / scale;
          if (sc[s] > mx) mx = sc[s];
        }
        float sum = 0.f;
        for (int s = 0; s < n; s++) {
          sc[s] = expf(sc[s] - mx);
          sum += sc[s];
        }
        float *ah = att + ((size_t)r * H + hh) * D;
        for (int d = 0; d < D; d++) ah[d] = 0.f;
        for (int s = 0; s < n; s++) {
          const float p = sc[s] / sum;
          if (bf16) {
            const uint16_t *vb = (const uint16_t *)sq->kv + vbase + (size_t)s * D;
            for (int d = 0; d < D; d++) ah[d] += p * bf16_to_f32(vb[d]);
          } else {
            const float *vs = (const float *)sq->kv + vbase + (size_t)s * D;
            for (int d = 0; d < D; d++) ah[d] += p * vs[d];
          }
        }
      }
    }
    (void)es;
    matmul(w->o, h, H * D, att, R, o);
    for (size_t i = 0; i < R_ * h; i++) x[i] += o[i];
    for (int r = 0; r < R; r++) rmsnorm(x + (size_t)r * h, w->post_norm, h, m->rms_norm_eps, hn + (size_t)r * h);
    matmul(w->gate, I, h, hn, R, g);
    matmul(w->up, I, h, hn, R, u);
    for (size_t i = 0; i < R_ * I; i++) g[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
    matmul(w->down, h, I, g, R, o);
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
    float *lg = malloc(sizeof(float) * (size_t)n_out * V);
    if (!lg) {
      rc = -1;
      goto out;
    }
    matmul(cb->lm_head, V, h, hn, n_out, lg);
    for (int r = 0; r < n_out; r++)
      memcpy(job->logits + (size_t)rows[r].out_lane * V, lg + (size_t)r * V, sizeof(float) * V);
    free(lg);
  }
out:
  free(x); free(hn); free(q); free(k); free(v); free(att); free(o); free(g); free(u);
  free(cs); free(sn); free(sc); free(kr); free(rows);
  return rc;
}
