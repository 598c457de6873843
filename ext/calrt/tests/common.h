/* Shared helpers of the plain-C harnesses: a tiny random model and weight tensors. */
#ifndef CALRT_TEST_COMMON_H
#define CALRT_TEST_COMMON_H
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "calrt.h"
#include "calrt_sim.h"

#define CHECK(cond)                                                                     \
  do {                                                                                  \
    if (!(cond)) {                                                                      \
      fprintf(stderr, "%s:%d: CHECK failed: %s (%s)\n", __FILE__, __LINE__, #cond,     \
              calrt_last_error());                                                      \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

/* The last failing call's message names `s`. */
#define ERR_HAS(s) (strstr(calrt_last_error(), (s)) != NULL)

/* Submit `j` on `e` and wait for it (10 s at most): its completion status. */
static inline calrt_job_status run(calrt_job *j, calrt_engine e) {
  calrt_job_status st = CALRT_JOB_INVALID;
  CHECK(calrt_job_submit(j, e) == CALRT_OK);
  CHECK(calrt_job_wait(j, 10 * 1000 * 1000, &st) == CALRT_OK);
  return st;
}

/* The first index of the largest of x[0..n) (the host's greedy token). */
static inline int argmax(const float *x, int n) {
  int b = 0;
  for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
  return b;
}

typedef struct test_model {
  calrt_model_desc m;
  int n;
  calrt_tensor t[64];
  char names[64][96];
  float *data[64];
} test_model;

static unsigned long long test_rng = 88172645463325252ULL;
static float frand(void) {
  test_rng ^= test_rng << 13; test_rng ^= test_rng >> 7; test_rng ^= test_rng << 17;
  return (float)((test_rng >> 40) & 0xFFFFFF) / 16777216.0f - 0.5f;
}

static void add(test_model *tm, const char *name, int64_t a, int64_t b, float base) {
  int i = tm->n++;
  snprintf(tm->names[i], 96, "%s", name);
  int64_t n = a * (b ? b : 1);
  tm->data[i] = malloc(sizeof(float) * (size_t)n);
  for (int64_t k = 0; k < n; k++) tm->data[i][k] = base + 0.3f * frand();
  tm->t[i] = (calrt_tensor){tm->names[i], tm->data[i], b ? 2 : 1, {a, b}};
}

/* A random model of `m`'s figures (Llama, Qwen2, Gemma 2: no q_norm/k_norm tensors; Qwen2: q/k/v
 * biases; Gemma 3 and 2: the MLP's input and output norms too). */
static void make_model_desc(test_model *tm, calrt_model_desc desc) {
  memset(tm, 0, sizeof *tm);
  tm->m = desc;
  const calrt_model_desc *m = &tm->m;
  const int gemma = m->arch == CALRT_ARCH_GEMMA3 || m->arch == CALRT_ARCH_GEMMA2;
  const int qk_norm = m->arch == CALRT_ARCH_QWEN3 || m->arch == CALRT_ARCH_GEMMA3, qkv_bias = m->arch == CALRT_ARCH_QWEN2;
  int h = m->hidden_size, d = m->head_dim, H = m->num_attention_heads, KV = m->num_key_value_heads;
  add(tm, "model.embed_tokens.weight", m->vocab_size, h, 0);
  char b[96];
  for (int l = 0; l < m->num_hidden_layers; l++) {
#define A(suffix, x, y, base) snprintf(b, 96, "model.layers.%d.%s", l, suffix); add(tm, b, x, y, base)
    A("input_layernorm.weight", h, 0, 1);
    A("self_attn.q_proj.weight", H * d, h, 0);
    A("self_attn.k_proj.weight", KV * d, h, 0);
    A("self_attn.v_proj.weight", KV * d, h, 0);
    if (qkv_bias) {
      A("self_attn.q_proj.bias", H * d, 0, 0);
      A("self_attn.k_proj.bias", KV * d, 0, 0);
      A("self_attn.v_proj.bias", KV * d, 0, 0);
    }
    A("self_attn.o_proj.weight", h, H * d, 0);
    if (qk_norm) {
      A("self_attn.q_norm.weight", d, 0, 1);
      A("self_attn.k_norm.weight", d, 0, 1);
    }
    A("post_attention_layernorm.weight", h, 0, 1);
    if (gemma) {
      A("pre_feedforward_layernorm.weight", h, 0, 1);
      A("post_feedforward_layernorm.weight", h, 0, 1);
    }
    A("mlp.gate_proj.weight", m->intermediate_size, h, 0);
    A("mlp.up_proj.weight", m->intermediate_size, h, 0);
    A("mlp.down_proj.weight", h, m->intermediate_size, 0);
#undef A
  }
  add(tm, "model.norm.weight", h, 0, 1);
  if (!m->tie_word_embeddings) add(tm, "lm_head.weight", m->vocab_size, h, 0);
}

/* The tiny Qwen3 of most tests (its kernels run on the engine thread alone: too small for the pool). */
static inline void make_model(test_model *tm, int tie) {
  make_model_desc(tm, (calrt_model_desc){61, 24, 40, 2, 4, 2, 8, 1e-6f, 10000.0, tie, CALRT_ARCH_QWEN3, 0, 0, 0, 0, 0, 0, 0});
}

/* A Llama (or Qwen2: `arch`) big enough that its gate/up matmuls (decode too) and prefill attention run on the pool. */
static inline void make_llama(test_model *tm, int tie, int arch) {
  make_model_desc(tm, (calrt_model_desc){300, 128, 1024, 2, 4, 2, 32, 1e-5f, 100000.0, tie, arch, 0, 0, 0, 0, 0, 0, 0});
}

/* A configured calbin of `tm` on chip 0: B lanes, max_seq positions, `seqs` KV sequences, a modeled
 * decode step of step_us (0: as fast as the kernels go). */
static inline calrt_calbin *test_calbin(calrt_device *dev, test_model *tm, int B, int max_seq, int seqs,
                                        double step_us) {
  calrt_profile p = {B, max_seq, seqs, CALRT_KV_FP32, 1, 0};
  calrt_timing t = {0};
  t.decode_step_us = step_us;
  calrt_calbin *cb;
  CHECK(calrt_calbin_create(dev, 0, &tm->m, tm->n ? tm->t : NULL, (size_t)tm->n, &p, &t, &cb) == CALRT_OK);
  CHECK(calrt_calbin_configure(cb) == CALRT_OK);
  return cb;
}

/* A new sequence with `n` prompt tokens prefilled (on PING); *first = the argmax of its logits. */
static inline int32_t test_prefilled(calrt_calbin *cb, const int32_t *prompt, int n, int32_t *first) {
  int32_t s;
  calrt_job *j;
  calrt_job_result r;
  CHECK(calrt_kv_create_sequence(cb, &s) == CALRT_OK);
  CHECK(calrt_job_create_prefill(cb, s, prompt, n, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
  *first = argmax(r.logits, r.vocab);
  calrt_job_release(j);
  return s;
}

static void free_model(test_model *tm) {
  for (int i = 0; i < tm->n; i++) free(tm->data[i]);
}
#endif
