/* kv.c — the KvManager of a calbin: sequences, committed lengths, RemoveTokensAtEnd, DoShift.
 * All metadata is guarded by the chip mutex; KV bytes are written only by the running job that holds
 * the sequence busy (Invariant: busy => exactly one running job writes it, nobody else touches it). */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

uint64_t sim_kv_seq_bytes(const calrt_calbin *cb) {
  uint64_t es = cb->p.kv_dtype == CALRT_KV_BF16 ? 2 : 4;
  return 2ULL * (uint64_t)cb->m.num_hidden_layers * (uint64_t)cb->m.num_key_value_heads *
         (uint64_t)cb->p.max_seq * (uint64_t)cb->m.head_dim * es;
}

sim_kvgroup *sim_kvgroup_new(calrt_calbin *cb) {
  sim_kvgroup *g = calloc(1, sizeof *g);
  if (!g) return NULL;
  g->seqs = calloc((size_t)cb->p.max_sequences, sizeof *g->seqs);
  if (!g->seqs) {
    free(g);
    return NULL;
  }
  g->id = atomic_fetch_add(&cb->dev->next_kv_group_id, 1);
  g->refs = 1;
  g->max_sequences = cb->p.max_sequences;
  g->seq_bytes = cb->kv_seq_bytes;
  g->shared_bytes = cb->shared_bytes;
  return g;
}

void sim_kvgroup_unref(sim_chip *ch, sim_kvgroup *g) {
  if (!g || --g->refs > 0) return;
  /* Invariant: the last member left with no job in flight, so no kernel reads these buffers. */
  for (int32_t i = 0; i < g->max_sequences; i++) free(g->seqs[i].kv);
  free(g->seqs);
  ch->dram_used -= g->shared_bytes;
  free(g);
}

void sim_kv_invalidate_all(calrt_calbin *cb) {
  if (!cb->seqs) return;
  for (int32_t i = 0; i < cb->p.max_sequences; i++)
    if (cb->seqs[i].allocated) cb->seqs[i].valid = 0;
}

/* Lock the chip and find a configured calbin's sequence. On error the chip is unlocked. */
static calrt_status lock_seq(calrt_calbin *cb, int32_t seq_id, sim_seq **out) {
  if (!cb) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin is NULL");
  pthread_mutex_lock(&cb->chip->mu);
  if (!cb->configured) {
    pthread_mutex_unlock(&cb->chip->mu);
    return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin %d is not configured", cb->id);
  }
  if (seq_id < 0 || seq_id >= cb->p.max_sequences || !cb->seqs[seq_id].allocated) {
    pthread_mutex_unlock(&cb->chip->mu);
    return sim_err(CALRT_E_INVALID_ARGUMENT, "seq_id: %d is not an allocated sequence", seq_id);
  }
  *out = &cb->seqs[seq_id];
  return CALRT_OK;
}

calrt_status calrt_kv_can_allocate(calrt_calbin *cb, int32_t n, int *ok) {
  if (!cb || !ok) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin/ok is NULL");
  if (n < 0) return sim_err(CALRT_E_INVALID_ARGUMENT, "n must be >= 0");
  pthread_mutex_lock(&cb->chip->mu);
  int32_t free_n = 0;
  if (cb->configured)
    for (int32_t i = 0; i < cb->p.max_sequences; i++) free_n += !cb->seqs[i].allocated;
  *ok = cb->configured && free_n >= n;
  pthread_mutex_unlock(&cb->chip->mu);
  return CALRT_OK;
}

calrt_status calrt_kv_create_sequence(calrt_calbin *cb, int32_t *seq_id) {
  if (!cb || !seq_id) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin/seq_id is NULL");
  pthread_mutex_lock(&cb->chip->mu);
  if (!cb->configured || cb->needs_reconfigure) {
    pthread_mutex_unlock(&cb->chip->mu);
    return cb->configured ? sim_err(CALRT_E_NEEDS_RECONFIGURE, "calbin %d must be reconfigured", cb->id)
                          : sim_err(CALRT_E_INVALID_ARGUMENT, "calbin %d is not configured", cb->id);
  }
  for (int32_t i = 0; i < cb->p.max_sequences; i++) {
    sim_seq *s = &cb->seqs[i];
    if (s->allocated) continue;
    int null = cb->dev->null_compute || !cb->has_weights;
    if (!null && !s->kv) {
      s->kv = calloc(1, (size_t)cb->kv_seq_bytes);
      if (!s->kv) {
        pthread_mutex_unlock(&cb->chip->mu);
        return sim_err(CALRT_E_HOST_OOM, "out of host memory for KV");
      }
    }
    s->allocated = 1;
    s->valid = 1;
    s->len = 0;
    *seq_id = i;
    pthread_mutex_unlock(&cb->chip->mu);
    return CALRT_OK;
  }
  pthread_mutex_unlock(&cb->chip->mu);
  return sim_err(CALRT_E_OUT_OF_SEQUENCES, "all %d KV sequences of calbin %d are in use",
                 cb->p.max_sequences, cb->id);
}

calrt_status calrt_kv_free_sequence(calrt_calbin *cb, int32_t seq_id) {
  sim_seq *s = NULL;
  calrt_status st = lock_seq(cb, seq_id, &s);
  if (st) return st;
  if (s->users) {
    pthread_mutex_unlock(&cb->chip->mu);
    return sim_err(CALRT_E_IN_USE, "seq_id: %d is used by %d job(s) in flight", seq_id, s->users);
  }
  /* Keep the KV buffer for reuse but scrub it so no stale bytes leak into the next owner: only the
   * positions ever written ([0, hwm) of each layer/kind/head block), so freeing a short sequence
   * neither costs nor touches (RSS) the whole max_seq buffer. */
  if (s->kv && s->hwm > 0) {
    size_t es = cb->p.kv_dtype == CALRT_KV_BF16 ? 2 : 4, D = (size_t)cb->m.head_dim;
    size_t S = (size_t)cb->p.max_seq, blocks = 2 * (size_t)cb->m.num_hidden_layers * (size_t)cb->m.num_key_value_heads;
    for (size_t b = 0; b < blocks; b++) memset((char *)s->kv + b * S * D * es, 0, (size_t)s->hwm * D * es);
  }
  s->hwm = 0;
  s->allocated = 0;
  s->valid = 0;
  s->len = 0;
  pthread_mutex_unlock(&cb->chip->mu);
  return CALRT_OK;
}

calrt_status calrt_kv_committed_len(calrt_calbin *cb, int32_t seq_id, int32_t *len) {
  sim_seq *s = NULL;
  calrt_status st = lock_seq(cb, seq_id, &s);
  if (st) return st;
  if (!s->valid) st = sim_err(CALRT_E_SEQUENCE_INVALID, "seq_id: %d was invalidated (reset/fault)", seq_id);
  else *len = s->len;
  pthread_mutex_unlock(&cb->chip->mu);
  return st;
}

calrt_status calrt_kv_sequence_valid(calrt_calbin *cb, int32_t seq_id, int *valid) {
  sim_seq *s = NULL;
  calrt_status st = lock_seq(cb, seq_id, &s);
  if (st) return st;
  *valid = s->valid;
  pthread_mutex_unlock(&cb->chip->mu);
  return CALRT_OK;
}

/* Common checks of the mutating KV ops: valid, not used by a job in flight. */
static calrt_status lock_mutable(calrt_calbin *cb, int32_t seq_id, sim_seq **out) {
  calrt_status st = lock_seq(cb, seq_id, out);
  if (st) return st;
  if (!(*out)->valid) st = sim_err(CALRT_E_SEQUENCE_INVALID, "seq_id: %d was invalidated (reset/fault)", seq_id);
  else if ((*out)->users) st = sim_err(CALRT_E_IN_USE, "seq_id: %d is used by a job in flight", seq_id);
  if (st) pthread_mutex_unlock(&cb->chip->mu);
  return st;
}

/* lock_mutable plus 0 <= n <= committed_len (the ops that drop n tokens). */
static calrt_status lock_droppable(calrt_calbin *cb, int32_t seq_id, int32_t n, sim_seq **out) {
  calrt_status st = lock_mutable(cb, seq_id, out);
  if (st) return st;
  if (n < 0 || n > (*out)->len) {
    int32_t len = (*out)->len;
    pthread_mutex_unlock(&cb->chip->mu);
    return sim_err(CALRT_E_INVALID_ARGUMENT, "n: %d not in [0, committed_len=%d]", n, len);
  }
  return CALRT_OK;
}

calrt_status calrt_kv_remove_tokens_at_end(calrt_calbin *cb, int32_t seq_id, int32_t n) {
  sim_seq *s = NULL;
  calrt_status st = lock_droppable(cb, seq_id, n, &s);
  if (st) return st;
  s->len -= n;
  pthread_mutex_unlock(&cb->chip->mu);
  return CALRT_OK;
}

calrt_status calrt_kv_do_shift(calrt_calbin *cb, int32_t seq_id, int32_t n) {
  sim_seq *s = NULL;
  calrt_status st = lock_droppable(cb, seq_id, n, &s);
  if (st) return st;
  if (s->kv && n > 0) {
    size_t es = cb->p.kv_dtype == CALRT_KV_BF16 ? 2 : 4;
    size_t row = (size_t)cb->m.head_dim * es, plane = row * (size_t)cb->p.max_seq;
    size_t planes = 2 * (size_t)cb->m.num_hidden_layers * (size_t)cb->m.num_key_value_heads;
    for (size_t pl = 0; pl < planes; pl++) {
      unsigned char *base = (unsigned char *)s->kv + pl * plane;
      memmove(base, base + (size_t)n * row, (size_t)(s->len - n) * row);
    }
  }
  s->len -= n;
  pthread_mutex_unlock(&cb->chip->mu);
  return CALRT_OK;
}

#define UNSUPPORTED(what) sim_err(CALRT_E_NOT_SUPPORTED, what " is not supported by CalRT 0.7.6 (spec 9.3)")
calrt_status calrt_kv_copy_prefix(calrt_calbin *cb, int32_t src, int32_t dst, int32_t n) {
  (void)cb; (void)src; (void)dst; (void)n;
  return UNSUPPORTED("copy_prefix");
}
calrt_status calrt_kv_keep_one(calrt_calbin *cb, int32_t seq_id) {
  (void)cb; (void)seq_id;
  return UNSUPPORTED("keep_one");
}
calrt_status calrt_kv_position_add(calrt_calbin *cb, int32_t seq_id, int32_t delta) {
  (void)cb; (void)seq_id; (void)delta;
  return UNSUPPORTED("position_add");
}
calrt_status calrt_kv_position_div(calrt_calbin *cb, int32_t seq_id, int32_t divisor) {
  (void)cb; (void)seq_id; (void)divisor;
  return UNSUPPORTED("position_div");
}
calrt_status calrt_kv_save_session(calrt_calbin *cb, int32_t seq_id, void *buf, size_t *n) {
  (void)cb; (void)seq_id; (void)buf; (void)n;
  return UNSUPPORTED("save_session");
}
calrt_status calrt_kv_load_session(calrt_calbin *cb, int32_t seq_id, const void *buf, size_t n) {
  (void)cb; (void)seq_id; (void)buf; (void)n;
  return UNSUPPORTED("load_session");
}

calrt_status calrt_sim_read_kv(calrt_calbin *cb, int32_t seq_id, void *buf, size_t *n) {
  if (!n) return sim_err(CALRT_E_INVALID_ARGUMENT, "n is NULL");
  sim_seq *s = NULL;
  calrt_status st = lock_seq(cb, seq_id, &s);
  if (st) return st;
  if (!s->kv) {
    pthread_mutex_unlock(&cb->chip->mu);
    return sim_err(CALRT_E_NOT_SUPPORTED, "no KV storage (null-compute device)");
  }
  size_t need = (size_t)cb->kv_seq_bytes;
  if (buf && *n >= need && !s->busy) memcpy(buf, s->kv, need);
  else if (buf && s->busy) st = sim_err(CALRT_E_IN_USE, "seq_id: %d is being written by a running job", seq_id);
  else if (buf) st = sim_err(CALRT_E_INVALID_ARGUMENT, "buffer too small: %zu < %zu", *n, need);
  *n = need;
  pthread_mutex_unlock(&cb->chip->mu);
  return st;
}
