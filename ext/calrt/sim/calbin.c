/* calbin.c — CreateCalbin / configure / ResetConfiguration / destroy, DRAM charging, introspection. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define N_LAYER_NAMES 16
static const char *LAYER_NAMES[N_LAYER_NAMES] = {
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
    "self_attn.k_norm.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "mlp.down_proj.weight", "self_attn.q_proj.bias", "self_attn.k_proj.bias",
    "self_attn.v_proj.bias", "pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight"};

/* Which of LAYER_NAMES a layer of the family has, in weight_shapes() order (Llama has no
 * q_norm/k_norm; Qwen2 is Llama with the q/k/v biases after the v projection; Gemma 3 is Qwen3 with
 * the MLP's two norms after post_attention_layernorm; Gemma 2 is Gemma 3 without q_norm/k_norm). */
static const int QWEN3_SLOTS[11] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10};
static const int LLAMA_SLOTS[9] = {0, 1, 2, 3, 4, 7, 8, 9, 10};
static const int QWEN2_SLOTS[12] = {0, 1, 2, 3, 11, 12, 13, 4, 7, 8, 9, 10};
static const int GEMMA3_SLOTS[13] = {0, 1, 2, 3, 4, 5, 6, 7, 14, 15, 8, 9, 10};
static const int GEMMA2_SLOTS[11] = {0, 1, 2, 3, 4, 7, 14, 15, 8, 9, 10};

static int layer_slots(const calrt_model_desc *m, const int **slots) {
  if (m->arch == CALRT_ARCH_LLAMA) {
    *slots = LLAMA_SLOTS;
    return 9;
  }
  if (m->arch == CALRT_ARCH_QWEN2) {
    *slots = QWEN2_SLOTS;
    return 12;
  }
  if (m->arch == CALRT_ARCH_GEMMA3) {
    *slots = GEMMA3_SLOTS;
    return 13;
  }
  if (m->arch == CALRT_ARCH_GEMMA2) {
    *slots = GEMMA2_SLOTS;
    return 11;
  }
  *slots = QWEN3_SLOTS;
  return 11;
}

/* The sim_layer field that holds LAYER_NAMES[j] of the family. post_norm is the MLP's input norm:
 * post_attention_layernorm, except in Gemma 3 and 2, where that tensor norms the attention's output and
 * the MLP's input norm is pre_feedforward_layernorm. */
static const float **layer_field(sim_layer *l, int32_t arch, int j) {
  const int gemma = arch == CALRT_ARCH_GEMMA3 || arch == CALRT_ARCH_GEMMA2;
  const float **f[N_LAYER_NAMES] = {
      &l->in_norm, &l->q, &l->k, &l->v, &l->o, &l->q_norm, &l->k_norm,
      gemma ? &l->attn_out_norm : &l->post_norm, &l->gate, &l->up, &l->down, &l->q_bias, &l->k_bias,
      &l->v_bias, &l->post_norm, &l->ffn_out_norm};
  return f[j];
}

/* Expected tensors in weight_shapes() order (reference.py). Returns the count. */
static int32_t expected_tensors(const calrt_model_desc *m, calrt_tensor_info *out) {
  int32_t n = 0;
  int64_t h = m->hidden_size, d = m->head_dim, I = m->intermediate_size;
  int64_t H = m->num_attention_heads, KV = m->num_key_value_heads;
#define T1(nm, a) do { if (out) { snprintf(out[n].name, sizeof out[n].name, "%s", nm); out[n].ndim = 1; \
      out[n].shape[0] = (a); out[n].shape[1] = 0; snprintf(out[n].dtype, 8, "float32"); } n++; } while (0)
#define T2(nm, a, b) do { if (out) { snprintf(out[n].name, sizeof out[n].name, "%s", nm); out[n].ndim = 2; \
      out[n].shape[0] = (a); out[n].shape[1] = (b); snprintf(out[n].dtype, 8, "float32"); } n++; } while (0)
  T2("model.embed_tokens.weight", m->vocab_size, h);
  char buf[96];
  for (int i = 0; i < m->num_hidden_layers; i++) {
    int64_t shp[N_LAYER_NAMES][2] = {{h, 0}, {H * d, h}, {KV * d, h}, {KV * d, h}, {h, H * d}, {d, 0},
                                     {d, 0}, {h, 0}, {I, h}, {I, h}, {h, I}, {H * d, 0}, {KV * d, 0},
                                     {KV * d, 0}, {h, 0}, {h, 0}};
    const int *slots;
    const int nl = layer_slots(m, &slots);
    for (int jj = 0; jj < nl; jj++) {
      const int j = slots[jj];
      snprintf(buf, sizeof buf, "model.layers.%d.%s", i, LAYER_NAMES[j]);
      if (shp[j][1] == 0) T1(buf, shp[j][0]);
      else T2(buf, shp[j][0], shp[j][1]);
    }
  }
  T1("model.norm.weight", h);
  if (!m->tie_word_embeddings) T2("lm_head.weight", m->vocab_size, h);
#undef T1
#undef T2
  return n;
}

static uint64_t weights_bytes(const calrt_calbin *cb) {
  uint64_t b = 0;
  for (int32_t i = 0; i < cb->n_tensors; i++) {
    uint64_t e = (uint64_t)cb->tinfo[i].shape[0];
    if (cb->tinfo[i].ndim == 2) e *= (uint64_t)cb->tinfo[i].shape[1];
    b += e * 4;
  }
  return b;
}

/* Activation scratch a compiled profile needs on the device (charged with the calbin). */
static uint64_t scratch_bytes(const calrt_calbin *cb) {
  const calrt_model_desc *m = &cb->m;
  uint64_t per_lane = (uint64_t)m->vocab_size + 4ULL * (uint64_t)m->hidden_size +
                      2ULL * (uint64_t)m->intermediate_size +
                      3ULL * (uint64_t)m->num_attention_heads * (uint64_t)m->head_dim;
  return per_lane * 4ULL * (uint64_t)cb->p.compiled_batch;
}

calrt_status calrt_calbin_create(calrt_device *dev, int chip, const calrt_model_desc *model,
                                 const calrt_tensor *tensors, size_t n_tensors,
                                 const calrt_profile *profile, const calrt_timing *timing,
                                 calrt_calbin **out) {
  if (!dev || !dev->open) return sim_err(CALRT_E_CLOSED, "device is not open");
  if (!model || !profile || !out) return sim_err(CALRT_E_INVALID_ARGUMENT, "model/profile/out must not be NULL");
  if (chip < 0 || chip >= CALRT_MAX_CHIPS)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "chip: %d out of range", chip);
  if (chip >= dev->info.chips)
    return sim_err(CALRT_E_NOT_SUPPORTED, "chip: chip-scoped configure (chip %d) is not supported by "
                   "runtime profile %s", chip, dev->info.profile);
  const calrt_model_desc *m = model;
  if (m->vocab_size < 1 || m->hidden_size < 1 || m->intermediate_size < 1 || m->num_hidden_layers < 1 ||
      m->num_attention_heads < 1 || m->num_key_value_heads < 1 || m->head_dim < 2 || m->head_dim % 2 ||
      m->num_attention_heads % m->num_key_value_heads || !(m->rms_norm_eps > 0) || !(m->rope_theta > 0) ||
      (m->arch != CALRT_ARCH_QWEN3 && m->arch != CALRT_ARCH_LLAMA && m->arch != CALRT_ARCH_QWEN2 &&
       m->arch != CALRT_ARCH_GEMMA3 && m->arch != CALRT_ARCH_GEMMA2))
    return sim_err(CALRT_E_INVALID_ARGUMENT, "model: invalid model description");
  if (m->sliding_window < 0 || m->sliding_window_pattern < 0 || !(m->rope_local_theta >= 0) ||
      !(m->query_pre_attn_scalar >= 0) || !(m->rope_scaling_factor >= 0))
    return sim_err(CALRT_E_INVALID_ARGUMENT, "model: sliding_window, sliding_window_pattern, "
                   "rope_local_theta, query_pre_attn_scalar and rope_scaling_factor must be >= 0");
  if (!(m->attn_logit_softcapping >= 0) || !isfinite(m->attn_logit_softcapping) ||
      !(m->final_logit_softcapping >= 0) || !isfinite(m->final_logit_softcapping))
    return sim_err(CALRT_E_INVALID_ARGUMENT, "model: attn_logit_softcapping and final_logit_softcapping "
                   "must be finite and >= 0 (0: none)");
  const calrt_profile *p = profile;
  if (p->compiled_batch < 1) return sim_err(CALRT_E_INVALID_ARGUMENT, "profile.compiled_batch must be >= 1");
  if (p->compiled_batch > 1 && !dev->info.batch_profiles)
    return sim_err(CALRT_E_NOT_SUPPORTED, "profile.compiled_batch: B=%d needs batch profiles (C3), not "
                   "supported by runtime profile %s", p->compiled_batch, dev->info.profile);
  if (p->compiled_batch > 1 && !p->valid_mask)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "profile.valid_mask: a B>1 profile without a valid-mask "
                   "contract is not usable (spec 7.3)");
  if (p->max_seq < 1) return sim_err(CALRT_E_INVALID_ARGUMENT, "profile.max_seq must be >= 1");
  if (p->max_sequences < 1) return sim_err(CALRT_E_INVALID_ARGUMENT, "profile.max_sequences must be >= 1");
  if (p->kv_dtype != CALRT_KV_FP32 && p->kv_dtype != CALRT_KV_BF16)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "profile.kv_dtype: unknown %d", (int)p->kv_dtype);
  if (timing && (timing->prefill_base_us < 0 || timing->prefill_us_per_token < 0 ||
                 timing->decode_step_us < 0 || timing->pingpong_overlap < 0 || timing->pingpong_overlap > 1))
    return sim_err(CALRT_E_INVALID_ARGUMENT, "timing: figures must be >= 0 and overlap in [0, 1]");

  int32_t n_exp = expected_tensors(m, NULL);
  calrt_calbin *cb = calloc(1, sizeof *cb);
  if (!cb) return sim_err(CALRT_E_HOST_OOM, "out of host memory");
  cb->tinfo = calloc((size_t)n_exp, sizeof *cb->tinfo);
  cb->layers = calloc((size_t)m->num_hidden_layers, sizeof *cb->layers);
  if (!cb->tinfo || !cb->layers) {
    free(cb->tinfo); free(cb->layers); free(cb);
    return sim_err(CALRT_E_HOST_OOM, "out of host memory");
  }
  expected_tensors(m, cb->tinfo);
  cb->n_tensors = n_exp;
  cb->m = *m;
  cb->p = *p;
  if (timing) cb->t = *timing;
  cb->dev = dev;
  cb->chip = &dev->chips[chip];

  calrt_status st = CALRT_OK;
  if (n_tensors == 0 && dev->null_compute) {
    cb->has_weights = 0;
  } else if (!tensors) {
    st = sim_err(CALRT_E_INVALID_ARGUMENT, "tensors: weights are required (device is not null-compute)");
  } else {
    /* The optional RoPE frequency divisors (calrt.h: ROPE_FREQS_TENSOR), then every expected
     * tensor exactly once with the expected shape; nothing extra. */
    int32_t n_opt = 0;
    for (size_t j = 0; st == CALRT_OK && j < n_tensors; j++) {
      if (!tensors[j].name || strcmp(tensors[j].name, CALRT_ROPE_FREQS_TENSOR) != 0) continue;
      if (n_opt++ || !tensors[j].data || tensors[j].ndim != 1 || tensors[j].shape[0] != m->head_dim / 2)
        st = sim_err(CALRT_E_INVALID_ARGUMENT, "tensors: '%s' must be given once, shape [%d]",
                     CALRT_ROPE_FREQS_TENSOR, m->head_dim / 2);
      else
        cb->rope_freqs = tensors[j].data;
    }
    if (st == CALRT_OK && (int32_t)n_tensors != n_exp + n_opt)
      st = sim_err(CALRT_E_INVALID_ARGUMENT, "tensors: expected %d tensors, got %zu", n_exp + n_opt, n_tensors);
    for (int32_t i = 0; st == CALRT_OK && i < n_exp; i++) {
      const calrt_tensor_info *ti = &cb->tinfo[i];
      const calrt_tensor *found = NULL;
      for (size_t j = 0; j < n_tensors; j++)
        if (tensors[j].name && strcmp(tensors[j].name, ti->name) == 0) { found = &tensors[j]; break; }
      if (!found) { st = sim_err(CALRT_E_INVALID_ARGUMENT, "tensors: missing '%s'", ti->name); break; }
      if (!found->data || found->ndim != ti->ndim || found->shape[0] != ti->shape[0] ||
          (ti->ndim == 2 && found->shape[1] != ti->shape[1])) {
        st = sim_err(CALRT_E_INVALID_ARGUMENT, "tensors: '%s' has the wrong shape (expected [%lld%s%lld])",
                     ti->name, (long long)ti->shape[0], ti->ndim == 2 ? ", " : "",
                     ti->ndim == 2 ? (long long)ti->shape[1] : 0LL);
        break;
      }
      /* map by position in weight_shapes() order */
      const float *dp = found->data;
      const int *lslots;
      const int nl = layer_slots(m, &lslots);
      if (i == 0) cb->embed = dp;
      else if (i <= nl * m->num_hidden_layers) {
        int L = (i - 1) / nl, j = lslots[(i - 1) % nl];
        *layer_field(&cb->layers[L], m->arch, j) = dp;
      } else if (i == nl * m->num_hidden_layers + 1) cb->final_norm = dp;
      else cb->lm_head = dp;
    }
    if (st == CALRT_OK && m->tie_word_embeddings) cb->lm_head = cb->embed;
    if (st == CALRT_OK) sim_weights_hugepages(tensors, n_tensors);
    cb->has_weights = 1;
  }
  if (st != CALRT_OK) {
    free(cb->tinfo); free(cb->layers); free(cb);
    return st;
  }
  cb->kv_seq_bytes = sim_kv_seq_bytes(cb);
  cb->shared_bytes = weights_bytes(cb) + cb->kv_seq_bytes * (uint64_t)p->max_sequences;
  cb->own_bytes = scratch_bytes(cb);
  pthread_mutex_lock(&dev->mu);
  cb->id = dev->next_calbin_id++;
  cb->next = dev->calbins;
  dev->calbins = cb;
  pthread_mutex_unlock(&dev->mu);
  *out = cb;
  return CALRT_OK;
}

calrt_status calrt_calbin_configure(calrt_calbin *cb) {
  if (!cb) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin is NULL");
  sim_chip *ch = cb->chip;
  calrt_device *dev = cb->dev;
  pthread_mutex_lock(&ch->mu);
  if (cb->configured && !cb->needs_reconfigure) {
    pthread_mutex_unlock(&ch->mu);
    return CALRT_OK;
  }
  if (ch->faulted || ch->resetting) {
    pthread_mutex_unlock(&ch->mu);
    return sim_err(CALRT_E_FAULTED, "chip %d needs a reset before configure", ch->index);
  }
  if (cb->configured && cb->needs_reconfigure) { /* weights re-uploaded; DRAM stays charged */
    cb->needs_reconfigure = 0;
    pthread_mutex_unlock(&ch->mu);
    return CALRT_OK;
  }
  if (!dev->info.multi_calbin) {
    pthread_mutex_lock(&dev->mu);
    int other = 0;
    for (calrt_calbin *o = dev->calbins; o; o = o->next)
      if (o != cb && o->configured) other = o->id;
    pthread_mutex_unlock(&dev->mu);
    if (other) {
      pthread_mutex_unlock(&ch->mu);
      return sim_err(CALRT_E_NOT_SUPPORTED, "calbin %d is configured: multi-calbin residency (C3) is not "
                     "supported by runtime profile %s; release it first", other, dev->info.profile);
    }
  }
  /* A calbin that joined a KV group (calrt_calbin_share_kv) pays only its own pools; otherwise it
   * starts its own group and pays weights + KV too. */
  uint64_t need = cb->own_bytes + (cb->kv ? 0 : cb->shared_bytes);
  if (need > ch->dram_capacity - ch->dram_used) {
    uint64_t free_b = ch->dram_capacity - ch->dram_used;
    pthread_mutex_unlock(&ch->mu);
    return sim_err(CALRT_E_OUT_OF_DEVICE_MEMORY, "DRAM reservation of %llu bytes does not fit on chip %d "
                   "(%llu free of %llu)", (unsigned long long)need, ch->index,
                   (unsigned long long)free_b, (unsigned long long)ch->dram_capacity);
  }
  if (!cb->kv) {
    cb->kv = sim_kvgroup_new(cb);
    if (!cb->kv) {
      pthread_mutex_unlock(&ch->mu);
      return sim_err(CALRT_E_HOST_OOM, "out of host memory");
    }
    cb->kv_joined = 0;
    cb->seqs = cb->kv->seqs;
  }
  ch->dram_used += need;
  cb->configured = 1;
  cb->needs_reconfigure = 0;
  pthread_mutex_unlock(&ch->mu);
  return CALRT_OK;
}

calrt_status calrt_calbin_reset_configuration(calrt_calbin *cb) {
  if (!cb) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin is NULL");
  sim_chip *ch = cb->chip;
  pthread_mutex_lock(&ch->mu);
  if (cb->inflight) {
    int n = cb->inflight;
    pthread_mutex_unlock(&ch->mu);
    return sim_err(CALRT_E_IN_USE, "calbin %d has %d job(s) in flight: wait for them or reset", cb->id, n);
  }
  if (cb->configured) {
    ch->dram_used -= cb->own_bytes;
    cb->configured = 0;
    cb->needs_reconfigure = 0;
  }
  /* Leave the KV group (also a joined-but-never-configured one); the last member frees the sequences,
   * the KV memory and the weights charge. */
  if (cb->kv) {
    sim_kvgroup_unref(ch, cb->kv);
    cb->kv = NULL;
    cb->seqs = NULL;
    cb->kv_joined = 0;
  }
  pthread_mutex_unlock(&ch->mu);
  return CALRT_OK;
}

/* The weight buffer of expected tensor `i` (weight_shapes() order), as mapped at create. */
static const float *tensor_ptr(const calrt_calbin *cb, int32_t i) {
  const int32_t L = cb->m.num_hidden_layers;
  const int *lslots;
  const int nl = layer_slots(&cb->m, &lslots);
  if (i == 0) return cb->embed;
  if (i <= nl * L) return *layer_field(&cb->layers[(i - 1) / nl], cb->m.arch, lslots[(i - 1) % nl]);
  if (i == nl * L + 1) return cb->final_norm;
  return cb->lm_head;
}

/* Why the two calbins cannot share KV + weights (message set), or CALRT_OK. */
static calrt_status kv_compatible(const calrt_calbin *cb, const calrt_calbin *o) {
  const calrt_model_desc *a = &cb->m, *b = &o->m;
#define SAME(f)                                                                                       \
  if (a->f != b->f)                                                                                   \
    return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: model." #f " differs (%g vs owner's %g)",     \
                   (double)a->f, (double)b->f)
  SAME(vocab_size); SAME(hidden_size); SAME(intermediate_size); SAME(num_hidden_layers);
  SAME(num_attention_heads); SAME(num_key_value_heads); SAME(head_dim); SAME(rms_norm_eps);
  SAME(rope_theta); SAME(tie_word_embeddings); SAME(arch); SAME(sliding_window);
  SAME(sliding_window_pattern); SAME(rope_local_theta); SAME(query_pre_attn_scalar); SAME(rope_scaling_factor);
  SAME(attn_logit_softcapping); SAME(final_logit_softcapping);
#undef SAME
  if (cb->p.max_seq != o->p.max_seq)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: profile.max_seq differs (%d vs owner's %d)",
                   cb->p.max_seq, o->p.max_seq);
  if (cb->p.max_sequences != o->p.max_sequences)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: profile.max_sequences differs (%d vs owner's %d): "
                   "the group has one KvManager", cb->p.max_sequences, o->p.max_sequences);
  if (cb->p.kv_dtype != o->p.kv_dtype)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: profile.kv_dtype differs (%s vs owner's %s)",
                   cb->p.kv_dtype == CALRT_KV_BF16 ? "bf16" : "fp32",
                   o->p.kv_dtype == CALRT_KV_BF16 ? "bf16" : "fp32");
  if (cb->has_weights != o->has_weights)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: one calbin has weights, the other none");
  if (cb->rope_freqs != o->rope_freqs)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: tensor '%s' is not the owner's buffer (shared "
                   "weights must be the very same buffers)", CALRT_ROPE_FREQS_TENSOR);
  if (cb->has_weights)
    for (int32_t i = 0; i < cb->n_tensors; i++)
      if (tensor_ptr(cb, i) != tensor_ptr(o, i))
        return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: tensor '%s' is not the owner's buffer (shared "
                       "weights must be the very same buffers)", cb->tinfo[i].name);
  return CALRT_OK;
}

calrt_status calrt_calbin_share_kv(calrt_calbin *cb, calrt_calbin *owner) {
  if (!cb || !owner) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin/kv_owner is NULL");
  calrt_device *dev = cb->dev;
  if (!dev->info.shared_kv)
    return sim_err(CALRT_E_NOT_SUPPORTED, "kv_owner: shared KV across calbins (C3) is not supported by "
                   "runtime profile %s", dev->info.profile);
  if (owner == cb) return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: a calbin cannot share with itself");
  if (owner->dev != dev) return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: belongs to another device");
  if (owner->chip != cb->chip)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: is on chip %d, this calbin on chip %d (KV lives in "
                   "one chip's DRAM)", owner->chip->index, cb->chip->index);
  calrt_status st = kv_compatible(cb, owner); /* immutable fields: no lock needed */
  if (st) return st;
  sim_chip *ch = cb->chip;
  pthread_mutex_lock(&ch->mu);
  if (cb->configured || cb->kv)
    st = sim_err(CALRT_E_INVALID_ARGUMENT, "calbin %d is already configured or in a KV group: share_kv "
                 "goes between create and configure", cb->id);
  else if (!owner->configured || !owner->kv)
    st = sim_err(CALRT_E_INVALID_ARGUMENT, "kv_owner: calbin %d is not configured", owner->id);
  else if (owner->needs_reconfigure)
    st = sim_err(CALRT_E_NEEDS_RECONFIGURE, "kv_owner: calbin %d must be reconfigured first (DMA state "
                 "unknown)", owner->id);
  if (st == CALRT_OK) {
    cb->kv = owner->kv;
    cb->kv->refs++;
    cb->kv_joined = 1;
    cb->seqs = cb->kv->seqs;
  }
  pthread_mutex_unlock(&ch->mu);
  return st;
}

calrt_status calrt_calbin_destroy(calrt_calbin *cb) {
  if (!cb) return CALRT_OK;
  calrt_status st = calrt_calbin_reset_configuration(cb);
  if (st) return st;
  calrt_device *dev = cb->dev;
  pthread_mutex_lock(&dev->mu);
  for (calrt_calbin **pp = &dev->calbins; *pp; pp = &(*pp)->next)
    if (*pp == cb) { *pp = cb->next; break; }
  pthread_mutex_unlock(&dev->mu);
  free(cb->tinfo);
  free(cb->layers);
  free(cb);
  return CALRT_OK;
}

calrt_status calrt_calbin_info_get(calrt_calbin *cb, calrt_calbin_info *out) {
  if (!cb || !out) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin/out is NULL");
  memset(out, 0, sizeof *out);
  pthread_mutex_lock(&cb->chip->mu);
  out->calbin_id = cb->id;
  out->chip = cb->chip->index;
  out->configured = cb->configured;
  out->needs_reconfigure = cb->needs_reconfigure;
  out->dram_bytes = cb->own_bytes + (cb->kv_joined ? 0 : cb->shared_bytes);
  out->kv_group_id = cb->kv ? cb->kv->id : 0;
  out->kv_group_size = cb->kv ? cb->kv->refs : 0;
  out->shared_dram_bytes = cb->shared_bytes;
  pthread_mutex_unlock(&cb->chip->mu);
  out->model = cb->m;
  out->profile = cb->p;
  out->num_tensors = cb->n_tensors;
  int es = cb->p.kv_dtype == CALRT_KV_BF16 ? 2 : 4;
  out->kv_bytes_per_token = 2ULL * (uint64_t)cb->m.num_hidden_layers * (uint64_t)cb->m.num_key_value_heads *
                            (uint64_t)cb->m.head_dim * (uint64_t)es;
  out->kv_shape[0] = cb->m.num_hidden_layers;
  out->kv_shape[1] = 2;
  out->kv_shape[2] = cb->m.num_key_value_heads;
  out->kv_shape[3] = cb->p.max_seq;
  out->kv_shape[4] = cb->m.head_dim;
  out->inactive_writes_kv = 0;
  out->null_compute = !cb->has_weights || cb->dev->null_compute;
  return CALRT_OK;
}

calrt_status calrt_calbin_tensor_info(calrt_calbin *cb, int32_t index, calrt_tensor_info *out) {
  if (!cb || !out) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin/out is NULL");
  if (index < 0 || index >= cb->n_tensors)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "index: %d not in [0, %d)", index, cb->n_tensors);
  *out = cb->tinfo[index];
  return CALRT_OK;
}
