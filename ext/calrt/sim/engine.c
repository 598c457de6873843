/* engine.c — jobs, the PING/PONG engines (one worker thread + FIFO queue each), submit/wait, the
 * timing model and completion. Lock order: chip->mu, then dev->mu, then job->mu. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif
#include <unistd.h>

#include "internal.h"

/* ---- job objects ---- */

static calrt_job *job_alloc(calrt_calbin *cb, job_kind kind, int32_t lanes, int32_t n_in) {
  calrt_job *j = calloc(1, sizeof *j);
  if (!j) return NULL;
  size_t V = (size_t)cb->m.vocab_size;
  j->tokens = calloc((size_t)n_in, sizeof(int32_t));
  j->seq_ids = calloc((size_t)lanes, sizeof(int32_t));
  j->positions = calloc((size_t)lanes, sizeof(int32_t));
  j->valid = calloc((size_t)lanes, 1);
  /* Not zeroed here: the submitting (host) thread would clear lanes x vocab floats a job (3 MB at B16
   * on a 49,152-token vocabulary, ~100 us of it). Execution writes every valid lane's row and
   * zeroes the others (execute), a failed job's rows are zeroed (complete); nothing reads the rows
   * before the job is done (calrt_job_result). */
  j->logits = malloc((size_t)lanes * V * sizeof(float));
  j->echo = calloc((size_t)lanes * 3, sizeof(int64_t));
  j->checksum = calloc((size_t)lanes, sizeof(uint64_t));
  if (!j->tokens || !j->seq_ids || !j->positions || !j->valid || !j->logits || !j->echo || !j->checksum) {
    free(j->tokens); free(j->seq_ids); free(j->positions); free(j->valid);
    free(j->logits); free(j->echo); free(j->checksum); free(j);
    return NULL;
  }
  atomic_init(&j->refs, 1);
  atomic_init(&j->abort, 0);
  j->id = atomic_fetch_add(&cb->dev->next_job_id, 1);
  j->cb = cb;
  j->chip = cb->chip;
  j->kind = kind;
  j->lanes = lanes;
  j->fault = -1;
  j->engine = -1;
  j->steps = 1;
  pthread_mutex_init(&j->mu, NULL);
  sim_cond_init(&j->cond);
  return j;
}

static void job_free(calrt_job *j) {
  pthread_mutex_destroy(&j->mu);
  pthread_cond_destroy(&j->cond);
  free(j->tokens); free(j->seq_ids); free(j->positions); free(j->valid);
  free(j->logits); free(j->echo); free(j->checksum); free(j->step_tokens); free(j->lane_steps); free(j);
}

void calrt_job_release(calrt_job *job) {
  if (job && atomic_fetch_sub(&job->refs, 1) == 1) job_free(job);
}

int64_t calrt_job_id(const calrt_job *job) { return job ? job->id : -1; }

/* A prefill job (all_logits: one output lane per token, calrt_job_create_prefill_all). */
static calrt_status create_prefill(calrt_calbin *cb, int32_t seq_id, const int32_t *tokens, int32_t n,
                                   int all_logits, calrt_job **out) {
  if (!cb || !tokens || !out) return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin/tokens/out is NULL");
  if (all_logits && !cb->dev->info.prompt_logits)
    return sim_err(CALRT_E_NOT_SUPPORTED, "prompt logits (a prefill returning every position's logits, C3) "
                   "are not supported by runtime profile %s", cb->dev->info.profile);
  if (n < 1) return sim_err(CALRT_E_INVALID_ARGUMENT, "tokens: a prefill needs at least one token");
  if (n > cb->p.max_seq)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "tokens: %d tokens exceed max_seq %d", n, cb->p.max_seq);
  if (seq_id < 0 || seq_id >= cb->p.max_sequences)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "seq_id: %d not in [0, %d)", seq_id, cb->p.max_sequences);
  for (int32_t i = 0; i < n; i++)
    if (tokens[i] < 0 || tokens[i] >= cb->m.vocab_size)
      return sim_err(CALRT_E_INVALID_ARGUMENT, "tokens[%d]: %d not in [0, vocab_size=%d)", i, tokens[i],
                     cb->m.vocab_size);
  const int32_t lanes = all_logits ? n : 1;
  calrt_job *j = job_alloc(cb, JOB_PREFILL, lanes, n);
  if (!j)
    return sim_err(CALRT_E_HOST_OOM, "out of host memory (a prefill job's buffers: %d output lane(s) of %d "
                   "logits)", lanes, cb->m.vocab_size);
  memcpy(j->tokens, tokens, sizeof(int32_t) * (size_t)n);
  j->n_tok = n;
  j->all_logits = all_logits;
  for (int32_t l = 0; l < lanes; l++) { /* every lane: the one sequence (see calrt_job.all_logits) */
    j->seq_ids[l] = seq_id;
    j->valid[l] = 1;
    j->positions[l] = -1; /* set at execution: committed_len + l */
  }
  *out = j;
  return CALRT_OK;
}

calrt_status calrt_job_create_prefill(calrt_calbin *cb, int32_t seq_id, const int32_t *tokens,
                                      int32_t n, calrt_job **out) {
  return create_prefill(cb, seq_id, tokens, n, 0, out);
}

calrt_status calrt_job_create_prefill_all(calrt_calbin *cb, int32_t seq_id, const int32_t *tokens,
                                          int32_t n, calrt_job **out) {
  return create_prefill(cb, seq_id, tokens, n, 1, out);
}

static calrt_status create_decode(calrt_calbin *cb, const int32_t *seq_ids, const int32_t *tokens,
                                  const int32_t *positions, const uint8_t *valid, int32_t lanes, int32_t steps,
                                  const int32_t *lane_steps, calrt_job **out) {
  if (!cb || !seq_ids || !tokens || !positions || !valid || !out)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "calbin/arrays/out is NULL");
  if (steps != 1 && !cb->dev->info.multi_step)
    return sim_err(CALRT_E_NOT_SUPPORTED, "multi-step decode (several greedy steps in one job, C3) is not "
                   "supported by runtime profile %s", cb->dev->info.profile);
  if (steps < 1 || steps > CALRT_MAX_DECODE_STEPS)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "steps: %d not in [1, %d]", steps, CALRT_MAX_DECODE_STEPS);
  if (lanes != cb->p.compiled_batch)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "lanes: %d != compiled_batch %d", lanes, cb->p.compiled_batch);
  int any = 0;
  for (int32_t l = 0; l < lanes; l++) {
    if (!valid[l]) {
      if (!cb->p.valid_mask)
        return sim_err(CALRT_E_INVALID_ARGUMENT, "valid[%d]: this profile has no valid mask; all lanes "
                       "must be valid", l);
      continue;
    }
    any = 1;
    if (seq_ids[l] < 0 || seq_ids[l] >= cb->p.max_sequences)
      return sim_err(CALRT_E_INVALID_ARGUMENT, "seq_ids[%d]: %d not in [0, %d)", l, seq_ids[l],
                     cb->p.max_sequences);
    if (tokens[l] < 0 || tokens[l] >= cb->m.vocab_size)
      return sim_err(CALRT_E_INVALID_ARGUMENT, "tokens[%d]: %d not in [0, vocab_size=%d)", l, tokens[l],
                     cb->m.vocab_size);
    if (positions[l] < 0 || positions[l] >= cb->p.max_seq)
      return sim_err(CALRT_E_INVALID_ARGUMENT, "positions[%d]: %d not in [0, max_seq=%d)", l, positions[l],
                     cb->p.max_seq);
    const int32_t n = lane_steps ? lane_steps[l] : steps;
    if (n < 1 || n > steps)
      return sim_err(CALRT_E_INVALID_ARGUMENT, "lane_steps[%d]: %d not in [1, steps=%d]", l, n, steps);
    if (positions[l] > cb->p.max_seq - n)
      return sim_err(CALRT_E_INVALID_ARGUMENT, "positions[%d]: %d + %d steps exceed max_seq=%d", l,
                     positions[l], n, cb->p.max_seq);
    for (int32_t o = 0; o < l; o++)
      if (valid[o] && seq_ids[o] == seq_ids[l])
        return sim_err(CALRT_E_INVALID_ARGUMENT, "seq_ids[%d]: sequence %d already in lane %d", l, seq_ids[l], o);
  }
  if (!any) return sim_err(CALRT_E_INVALID_ARGUMENT, "valid: a decode job needs at least one valid lane");
  calrt_job *j = job_alloc(cb, JOB_DECODE, lanes, lanes);
  if (!j) return sim_err(CALRT_E_HOST_OOM, "out of host memory");
  if (steps > 1) {
    j->step_tokens = calloc((size_t)lanes * (size_t)steps, sizeof(int32_t));
    j->lane_steps = calloc((size_t)lanes, sizeof(int32_t));
    if (!j->step_tokens || !j->lane_steps) {
      job_free(j);
      return sim_err(CALRT_E_HOST_OOM, "out of host memory");
    }
    for (int32_t l = 0; l < lanes; l++) j->lane_steps[l] = !valid[l] ? 0 : lane_steps ? lane_steps[l] : steps;
  }
  j->steps = steps;
  for (int32_t l = 0; l < lanes; l++) {
    j->valid[l] = valid[l] ? 1 : 0;
    j->seq_ids[l] = valid[l] ? seq_ids[l] : -1;
    j->tokens[l] = valid[l] ? tokens[l] : 0;
    j->positions[l] = valid[l] ? positions[l] : -1;
  }
  j->n_tok = 1;
  *out = j;
  return CALRT_OK;
}

calrt_status calrt_job_create_decode(calrt_calbin *cb, const int32_t *seq_ids, const int32_t *tokens,
                                     const int32_t *positions, const uint8_t *valid, int32_t lanes,
                                     calrt_job **out) {
  return create_decode(cb, seq_ids, tokens, positions, valid, lanes, 1, NULL, out);
}

calrt_status calrt_job_create_decode_steps(calrt_calbin *cb, const int32_t *seq_ids, const int32_t *tokens,
                                           const int32_t *positions, const uint8_t *valid, int32_t lanes,
                                           int32_t steps, const int32_t *lane_steps, calrt_job **out) {
  return create_decode(cb, seq_ids, tokens, positions, valid, lanes, steps, lane_steps, out);
}

/* ---- submit / wait ---- */

static void seq_users(calrt_job *j, int delta) {
  for (int32_t l = 0; l < sim_job_seq_lanes(j); l++) /* each sequence once (a prefill-all's too) */
    if (j->valid[l]) j->cb->seqs[j->seq_ids[l]].users += delta;
}

calrt_status calrt_job_submit(calrt_job *job, calrt_engine engine) {
  if (!job) return sim_err(CALRT_E_INVALID_ARGUMENT, "job is NULL");
  if (engine != CALRT_ENGINE_PING && engine != CALRT_ENGINE_PONG)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "engine: %d is not PING(0) or PONG(1)", (int)engine);
  calrt_calbin *cb = job->cb;
  sim_chip *ch = cb->chip;
  if (engine == CALRT_ENGINE_PONG && !cb->dev->info.pingpong)
    return sim_err(CALRT_E_NOT_SUPPORTED, "PONG engine is not available in this runtime profile");
  pthread_mutex_lock(&ch->mu);
  calrt_status st = CALRT_OK;
  sim_engine *e = &ch->engines[engine];
  if (job->state != JOB_CREATED) st = sim_err(CALRT_E_INVALID_ARGUMENT, "job %lld was already submitted",
                                              (long long)job->id);
  else if (ch->faulted || ch->resetting)
    st = sim_err(CALRT_E_FAULTED, "chip %d %s", ch->index, ch->resetting ? "is resetting" : "needs a reset");
  else if (!cb->configured) st = sim_err(CALRT_E_INVALID_ARGUMENT, "calbin %d is not configured", cb->id);
  else if (cb->needs_reconfigure)
    st = sim_err(CALRT_E_NEEDS_RECONFIGURE, "calbin %d must be reconfigured (DMA state unknown)", cb->id);
  for (int32_t l = 0; st == CALRT_OK && l < sim_job_seq_lanes(job); l++)
    if (job->valid[l] && !cb->seqs[job->seq_ids[l]].allocated)
      st = sim_err(CALRT_E_INVALID_ARGUMENT, "seq_ids[%d]: %d is not an allocated sequence", l, job->seq_ids[l]);
  if (st == CALRT_OK && e->n_queued >= CALRT_QUEUE_DEPTH) {
    e->counters.busy++;
    st = sim_err(CALRT_E_BUSY, "engine %s of chip %d is full (%d jobs)", engine ? "PONG" : "PING", ch->index,
                 CALRT_QUEUE_DEPTH);
  }
  if (st == CALRT_OK) {
    int32_t lane = 0;
    int f = sim_fault_take(e, &lane);
    if (f == CALRT_SIM_FAULT_BUSY) {
      e->counters.busy++;
      st = sim_err(CALRT_E_BUSY, "engine %s of chip %d is busy (injected)", engine ? "PONG" : "PING", ch->index);
    } else {
      job->fault = f;
      job->fault_lane = lane;
    }
  }
  if (st != CALRT_OK) {
    pthread_mutex_unlock(&ch->mu);
    return st;
  }
  atomic_fetch_add(&job->refs, 1); /* the engine's reference */
  job->engine = (int)engine;
  job->state = JOB_QUEUED;
  job->submit_us = sim_now_us();
  pthread_mutex_lock(&job->mu);
  job->submitted = 1;
  pthread_mutex_unlock(&job->mu);
  e->queue[e->n_queued++] = job;
  atomic_store_explicit(&e->queued_hint, e->n_queued, memory_order_release);
  e->counters.submitted++;
  cb->inflight++;
  seq_users(job, +1);
  /* Signalled after the unlock: woken under the lock, the worker would block on the mutex we still
   * hold and need a second wake-up (two futex calls, an IPI each on a VM, on every submit). The
   * worker re-checks n_queued under the mutex, so nothing is lost. */
  pthread_mutex_unlock(&ch->mu);
  pthread_cond_signal(&e->cond);
  return CALRT_OK;
}

calrt_status calrt_job_wait(calrt_job *job, int64_t timeout_us, calrt_job_status *status) {
  if (!job) return sim_err(CALRT_E_INVALID_ARGUMENT, "job is NULL");
  pthread_mutex_lock(&job->mu);
  if (!job->submitted) {
    pthread_mutex_unlock(&job->mu);
    return sim_err(CALRT_E_INVALID_ARGUMENT, "job %lld was never submitted", (long long)job->id);
  }
  struct timespec ts;
  if (timeout_us >= 0) sim_deadline_ts(sim_now_us() + (double)timeout_us, &ts);
  while (!job->done) {
    if (timeout_us < 0) {
      pthread_cond_wait(&job->cond, &job->mu);
    } else if (pthread_cond_timedwait(&job->cond, &job->mu, &ts) == ETIMEDOUT) {
      break;
    }
  }
  int done = job->done;
  if (done && status) *status = job->status;
  pthread_mutex_unlock(&job->mu);
  if (!done) {
    /* The chip is static storage and outlives every job, so this is safe even across close(). */
    atomic_fetch_add(&job->chip->engines[job->engine].timeouts, 1);
    return sim_err(CALRT_E_TIMEOUT, "job %lld did not complete within %lld us", (long long)job->id,
                   (long long)timeout_us);
  }
  return CALRT_OK;
}

int calrt_job_done(calrt_job *job) {
  if (!job) return 0;
  pthread_mutex_lock(&job->mu);
  int d = job->done;
  pthread_mutex_unlock(&job->mu);
  return d;
}

calrt_status calrt_job_result_get(calrt_job *job, calrt_job_result *out) {
  if (!job || !out) return sim_err(CALRT_E_INVALID_ARGUMENT, "job/out is NULL");
  pthread_mutex_lock(&job->mu);
  int d = job->done;
  pthread_mutex_unlock(&job->mu);
  if (!d) return sim_err(CALRT_E_INVALID_ARGUMENT, "job %lld has not completed", (long long)job->id);
  /* After done, the outputs are immutable until release. */
  out->job_id = job->id;
  out->status = job->status;
  out->lanes = job->lanes;
  out->vocab = job->vocab;
  out->logits = job->logits;
  out->echo = job->echo;
  out->checksum = job->checksum;
  out->device_us = job->device_us;
  return CALRT_OK;
}

calrt_status calrt_job_step_tokens(calrt_job *job, const int32_t **tokens, int32_t *steps) {
  if (!job || !tokens || !steps) return sim_err(CALRT_E_INVALID_ARGUMENT, "job/tokens/steps is NULL");
  if (!job->step_tokens)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "job %lld is not a multi-step decode", (long long)job->id);
  pthread_mutex_lock(&job->mu);
  int d = job->done;
  pthread_mutex_unlock(&job->mu);
  if (!d) return sim_err(CALRT_E_INVALID_ARGUMENT, "job %lld has not completed", (long long)job->id);
  *tokens = job->step_tokens;
  *steps = job->steps;
  return CALRT_OK;
}

/* ---- the engine worker ---- */

/* Validate at execution (chip->mu held). Prefill: its position is the sequence's committed_len (a
 * prefill-all's lane l: committed_len + l). */
static int validate_at_execution(calrt_job *j) {
  calrt_calbin *cb = j->cb;
  const int32_t seq_lanes = sim_job_seq_lanes(j);
  for (int32_t l = 0; l < seq_lanes; l++) {
    if (!j->valid[l]) continue;
    sim_seq *s = &cb->seqs[j->seq_ids[l]];
    if (!s->allocated || !s->valid || s->busy) return 0;
    if (j->kind == JOB_PREFILL) {
      if (s->len + j->n_tok > cb->p.max_seq) return 0;
      for (int32_t o = 0; o < j->lanes; o++) j->positions[o] = s->len + o; /* one lane unless all_logits */
    } else if (j->positions[l] != s->len) {
      return 0;
    }
  }
  for (int32_t l = 0; l < seq_lanes; l++) { /* the job may write up to here (even if it then faults) */
    if (!j->valid[l]) continue;
    sim_seq *s = &cb->seqs[j->seq_ids[l]];
    int32_t end = (j->kind == JOB_PREFILL ? j->positions[0] : j->positions[l]) + sim_job_kv_tokens(j, l);
    if (end > s->hwm) s->hwm = end;
  }
  return 1;
}

static void set_busy(calrt_job *j, int busy) {
  for (int32_t l = 0; l < sim_job_seq_lanes(j); l++)
    if (j->valid[l]) j->cb->seqs[j->seq_ids[l]].busy = busy;
}

/* Complete the job at the head of the engine's queue (chip->mu held). */
static void complete(sim_engine *e, calrt_job *j, calrt_job_status status, double start_us,
                     double device_us) {
  calrt_calbin *cb = j->cb;
  size_t V = (size_t)cb->m.vocab_size;
  if (status != CALRT_JOB_OK) {
    memset(j->logits, 0, sizeof(float) * V * (size_t)j->lanes);
    memset(j->checksum, 0, sizeof(uint64_t) * (size_t)j->lanes);
    if (j->step_tokens) memset(j->step_tokens, 0, sizeof(int32_t) * (size_t)j->lanes * (size_t)j->steps);
  }
  for (int32_t l = 0; l < j->lanes; l++) {
    j->echo[3 * l + 0] = j->id;
    j->echo[3 * l + 1] = j->valid[l] ? j->seq_ids[l] : -1;
    /* a prefill's one lane: its last position; a prefill-all's lane l: position l of the prompt */
    j->echo[3 * l + 2] = !j->valid[l]                ? -1
                         : j->kind != JOB_PREFILL    ? j->positions[l]
                         : j->all_logits             ? j->positions[0] + l
                                                     : j->positions[0] + j->n_tok - 1;
  }
  if (status == CALRT_JOB_OK) e->counters.completed++;
  else e->counters.failed++;
  /* Invariant: the completed job is queue[0] (FIFO, one running at a time). */
  for (int i = 1; i < e->n_queued; i++) e->queue[i - 1] = e->queue[i];
  e->queue[--e->n_queued] = NULL;
  atomic_store_explicit(&e->queued_hint, e->n_queued, memory_order_relaxed);
  cb->inflight--;
  seq_users(j, -1);
  j->vocab = (int32_t)V;
  j->cb = NULL; /* never touched again: the calbin may be destroyed from now on */
  pthread_cond_broadcast(&e->chip->changed);
  pthread_mutex_lock(&j->mu);
  j->status = status;
  j->device_us = start_us <= 0 ? 0.0 : status == CALRT_JOB_OK && device_us >= 0 ? device_us
                                                                               : sim_now_us() - start_us;
  j->state = JOB_DONE;
  j->done = 1;
  pthread_cond_broadcast(&j->cond);
  pthread_mutex_unlock(&j->mu);
  /* Invariant: the notification follows done = 1 (both visible to a reader that drains, then checks
   * done): a waiter that saw "not done" is woken by this write. */
  if (e->completion_fd >= 0) {
    uint64_t one = 1;
    ssize_t w;
    do w = write(e->completion_fd, &one, sizeof one); while (w < 0 && errno == EINTR);
    /* EAGAIN only at a counter of 2^64-2 (never drained): it is readable then anyway. */
  }
  calrt_job_release(j); /* the engine's reference */
}

/* The first index of the row's largest value, a NaN counting as the largest (numpy's argmax). */
static int32_t argmax_row(const float *row, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 0; i < n; i++) {
    if (row[i] != row[i]) return i; /* NaN */
    if (row[i] > row[best]) best = i;
  }
  return best;
}

/* A multi-step decode (calrt_job_create_decode_steps): `steps` forward passes, lane l in the first
 * lane_steps[l] of them, each lane's argmax fed back as its next input at the next position. The
 * lanes' positions and tokens are the job's inputs for the step being run; a lane past its steps is
 * left out of the later passes as an invalid lane is (its valid flag cleared meanwhile: nothing but
 * this job's worker reads it between validation and completion, both under chip->mu), so its
 * position stays at, and its logits row holds, its last step's (what the echo and checksum report).
 * Returns what sim_forward does (0, 1 aborted, < 0 host OOM), stopping at the first step that does
 * not return 0; the valid flags are restored either way. */
static int forward_steps(calrt_calbin *cb, calrt_job *j, int null, sim_pool *pool) {
  const int32_t V = cb->m.vocab_size, S = j->steps;
  int rc = 0;
  for (int32_t k = 0; k < S && rc == 0; k++) {
    if (k > 0) {
      if (atomic_load(&j->abort)) {
        rc = 1;
        break;
      }
      for (int32_t l = 0; l < j->lanes; l++) {
        if (!j->valid[l]) continue;
        if (k >= j->lane_steps[l]) {
          j->valid[l] = 0; /* this lane's steps are done */
          continue;
        }
        j->tokens[l] = j->step_tokens[(size_t)l * (size_t)S + (size_t)(k - 1)];
        j->positions[l] += 1;
      }
    }
    rc = sim_forward(cb, j, null, pool);
    if (rc == 0)
      for (int32_t l = 0; l < j->lanes; l++)
        if (j->valid[l])
          j->step_tokens[(size_t)l * (size_t)S + (size_t)k] = argmax_row(j->logits + (size_t)l * (size_t)V, V);
  }
  for (int32_t l = 0; l < j->lanes; l++) j->valid[l] = j->lane_steps[l] > 0;
  return rc;
}

/* Run queue[0] (chip->mu held; released during compute and modeled time). Returns its status.
 * *start_io: in, when this worker took the job; out, its modeled start on the device. *device_us:
 * how long the job had the device (see below; < 0: until now). */
static calrt_job_status run(sim_engine *e, calrt_job *j, double *start_io, double *device_us) {
  double start = *start_io;
  *device_us = -1.0;
  sim_chip *ch = e->chip;
  calrt_calbin *cb = j->cb;
  if (atomic_load(&j->abort)) return CALRT_JOB_ABORTED;
  if (!validate_at_execution(j)) return CALRT_JOB_INVALID;
  if (j->fault == CALRT_SIM_FAULT_TIMEOUT) { /* hang until a reset aborts it */
    while (!atomic_load(&j->abort)) pthread_cond_wait(&ch->changed, &ch->mu);
    return CALRT_JOB_ABORTED;
  }
  set_busy(j, 1);
  int null = cb->dev->null_compute;
  pthread_mutex_unlock(&ch->mu);
  const int computes = !null && cb->has_weights;
  if (!e->pool && computes) {
    e->pool = sim_pool_new(sim_pool_default_threads());
    sim_pool_share(e->pool, &cb->dev->computing); /* the host's CPUs, shared with the other engines */
  }
  const double d = sim_modeled_us(cb, j); /* the modeled device time (0: timing none) */
  /* the computation's CPU time on this thread, for a timed job (see device_us below) */
  struct timespec c0 = {0, 0}, c1 = {0, 0};
  if (d > 0) clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c0);
  if (computes) atomic_fetch_add(&cb->dev->computing, 1);
  int rc = j->steps > 1 ? forward_steps(cb, j, null, e->pool) : sim_forward(cb, j, null, e->pool);
  if (computes) atomic_fetch_sub(&cb->dev->computing, 1);
  size_t V = (size_t)cb->m.vocab_size;
  for (int32_t l = 0; l < j->lanes; l++) {
    float *row = j->logits + (size_t)l * V;
    if (j->valid[l]) {
      j->checksum[l] = calrt_checksum(row, V * sizeof(float));
    } else { /* an invalid lane's row is all zeros (calrt.h; job_alloc) */
      memset(row, 0, V * sizeof(float));
      j->checksum[l] = 0;
    }
  }
  if (d > 0) clock_gettime(CLOCK_THREAD_CPUTIME_ID, &c1);
  const double compute_wall_us = sim_now_us() - start;
  const double compute_cpu_us =
      (double)(c1.tv_sec - c0.tv_sec) * 1e6 + (double)(c1.tv_nsec - c0.tv_nsec) / 1e3;
  pthread_mutex_lock(&ch->mu);
  /* Timing model: the shared part of the job ((1 - overlap) of it) serialises with the other engine.
   * The modeled device starts a job when it is submitted (or when the engine's previous job ends),
   * not when this worker thread got a CPU: on a busy host the thread's wake-up latency would
   * otherwise be added to every job as if it were device time. */
  double end = start;
  if (d > 0) {
    double t0 = j->submit_us > e->free_at_us ? j->submit_us : e->free_at_us;
    if (t0 > start) t0 = start;
    double s = t0 > ch->shared_free_at_us ? t0 : ch->shared_free_at_us;
    ch->shared_free_at_us = s + (1.0 - cb->t.pingpong_overlap) * d;
    end = s + d;
    e->free_at_us = end;
    /* device_us counts from when the job got the device: its modeled start on the engine after
     * waiting for the other engine's serialised share (s), so that two engines' [start, end]
     * spans overlap exactly as much as the timing model lets them (a trace then shows the
     * PING/PONG overlap, not the queueing in front of it). */
    *start_io = s;
  }
  if (cb->dev->jitter_us > 0) end += (double)(sim_rng_next(&ch->rng) % (uint64_t)(cb->dev->jitter_us + 1));
  /* The job's time on the device, by the device's clock. With a timing model: the modeled span (with
   * the jitter), or the computation's CPU time on this thread when that is longer (the host cannot
   * compute the model at the modeled rate). Timing none: the computation's wall time (the host is the
   * device). Not this thread's wake-up after the timed wait below, nor the time its computation
   * waited for a CPU another thread of the host held: that is the host's scheduling, which a device's
   * clock would not see. (Counted in, a serving host busy enough to wake the worker late read as a
   * slow device step: spec §14's P99 condition turned PING/PONG off, and the device then idled while
   * the host turned each job around.) */
  const double span_us = end - *start_io, own_us = d > 0 ? compute_cpu_us : compute_wall_us;
  *device_us = span_us > own_us ? span_us : own_us;
  struct timespec ts;
  sim_deadline_ts(end, &ts);
  while (!atomic_load(&j->abort) && sim_now_us() < end)
    if (pthread_cond_timedwait(&ch->changed, &ch->mu, &ts) == ETIMEDOUT) break;
  set_busy(j, 0);
  if (rc < 0) return CALRT_JOB_CCU_FAULT; /* host OOM inside the kernels: report as a compute fault */
  if (rc > 0 || atomic_load(&j->abort)) return CALRT_JOB_ABORTED;
  if (j->fault == CALRT_SIM_FAULT_CCU || j->fault == CALRT_SIM_FAULT_DMA_UNKNOWN) {
    for (int32_t l = 0; l < sim_job_seq_lanes(j); l++)
      if (j->valid[l]) cb->seqs[j->seq_ids[l]].valid = 0; /* KV unknown */
    ch->faulted = 1;
    if (j->fault == CALRT_SIM_FAULT_DMA_UNKNOWN) {
      ch->dma_unknown = 1;
      return CALRT_JOB_DMA_UNKNOWN;
    }
    return CALRT_JOB_CCU_FAULT;
  }
  for (int32_t l = 0; l < sim_job_seq_lanes(j); l++) /* a prefill-all commits its n_tok tokens once */
    if (j->valid[l]) cb->seqs[j->seq_ids[l]].len += sim_job_kv_tokens(j, l);
  if (j->fault == CALRT_SIM_FAULT_CROSSTALK) sim_apply_crosstalk(j, j->fault_lane);
  return CALRT_JOB_OK;
}

/* The worker's wait for its next job. A device never sleeps: a submit rings its doorbell and it
 * starts. A worker thread blocked on a condition variable needs a futex wake-up instead, on a VM an
 * inter-processor interrupt to a halted vCPU: ~10 us in the submitting thread's call and ~10-20 us
 * more before the worker runs (2-vCPU KVM guest, the demo model at B1: a 27 us job took 48 us from
 * the end of its submit's after-work to its completion's wake-up, and the submit call itself 13 us).
 * That is host scheduling, not device time, and with one job in flight it is paid on every step.
 * So after each job the worker first polls for the next one for up to `window` microseconds (spin:
 * PAUSE, no lock, the submit's queued_hint) and only then blocks. The window adapts as KVM's
 * halt-polling does: a job that arrives while the worker sleeps but within the cap grows it (a
 * longer poll would have caught it), a job that comes later than the cap halves it (nothing came
 * while polling: the host is idle or slow, polling is wasted), down to none. An idle engine polls
 * at most a few times, then costs nothing. CALRT_SIM_ENGINE_SPIN_US sets the cap (0: never poll);
 * by default 200 us, none for a worker that may run on one CPU only (a server pinned to a core). */
sim_engine_poll sim_engine_poll_new(void) {
  const char *env = getenv("CALRT_SIM_ENGINE_SPIN_US");
  /* On one CPU the poll would only take turns with the thread that is to submit the next job. */
  double cap = sim_usable_cpus() >= 2 ? SIM_ENGINE_SPIN_CAP_US : 0.0;
  if (env && *env) {
    char *end = NULL;
    const double v = strtod(env, &end);
    if (end != env && *end == '\0' && v >= 0.0 && v <= 1e6) cap = v;
  }
  return (sim_engine_poll){cap, cap};
}

/* A job came `idle_us` after the worker began waiting, and the poll did not catch it. */
void sim_engine_poll_missed(sim_engine_poll *p, double idle_us) {
  if (idle_us <= p->cap) { /* a longer poll would have caught it */
    p->window = p->window * 2.0 > SIM_ENGINE_SPIN_MIN_US ? p->window * 2.0 : SIM_ENGINE_SPIN_MIN_US;
    if (p->window > p->cap) p->window = p->cap;
  } else { /* nothing came while polling: the host is idle or slow */
    p->window = p->window / 2.0 >= SIM_ENGINE_SPIN_MIN_US ? p->window / 2.0 : 0.0;
  }
}

/* Wait until the engine has a job or the chip stops (chip->mu held on entry and on return). */
static void wait_for_job(sim_engine *e, sim_engine_poll *poll) {
  sim_chip *ch = e->chip;
  if (ch->stop || e->n_queued > 0) return;
  const double t0 = sim_now_us();
  if (poll->window > 0.0) {
    pthread_mutex_unlock(&ch->mu);
    for (int i = 1; atomic_load_explicit(&e->queued_hint, memory_order_acquire) == 0; i++) {
      sim_cpu_relax();
      if ((i & 63) == 0 && sim_now_us() - t0 > poll->window) break;
    }
    pthread_mutex_lock(&ch->mu);
    if (ch->stop || e->n_queued > 0) return; /* caught while polling: the window stays */
  }
  while (!ch->stop && e->n_queued == 0) pthread_cond_wait(&e->cond, &ch->mu);
  if (!ch->stop) sim_engine_poll_missed(poll, sim_now_us() - t0);
}

static void *worker(void *arg) {
  sim_engine *e = arg;
  sim_chip *ch = e->chip;
#if defined(__linux__) && defined(PR_SET_TIMERSLACK)
  /* The modeled time ends on a timed wait: Linux's default 50 us timer slack would let every job
   * run ~50 us past its modeled end (a simulation artefact, not device time). 1 ns: as exact as
   * the kernel's timers allow. */
  prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
#endif
  sim_engine_poll poll = sim_engine_poll_new();
  pthread_mutex_lock(&ch->mu);
  for (;;) {
    wait_for_job(e, &poll);
    if (ch->stop) break;
    calrt_job *j = e->queue[0];
    j->state = JOB_RUNNING;
    double start = sim_now_us(), device_us;
    calrt_job_status st = run(e, j, &start, &device_us);
    complete(e, j, st, start, device_us);
  }
  pthread_mutex_unlock(&ch->mu);
  sim_pool_free(e->pool); /* only this thread ever used it */
  e->pool = NULL;
  return NULL;
}

int sim_engines_start(sim_chip *ch) {
  for (int i = 0; i < 2; i++) {
    sim_engine *e = &ch->engines[i];
    e->chip = ch;
    e->index = i;
    sim_cond_init(&e->cond);
    atomic_init(&e->timeouts, 0);
    atomic_init(&e->queued_hint, 0);
    e->completion_fd = -1;
    if (pthread_create(&e->thread, NULL, worker, e) == 0) {
      /* Named so a host can tell the simulated device's CPU from its own (bench/procstat.py). */
      char name[16];
      snprintf(name, sizeof name, "calrt-sim-%s%u", i ? "pong" : "ping", (unsigned)ch->index % 10u);
      pthread_setname_np(e->thread, name);
    } else {
      if (i == 1) {
        pthread_mutex_lock(&ch->mu);
        ch->stop = 1;
        pthread_cond_signal(&ch->engines[0].cond);
        pthread_mutex_unlock(&ch->mu);
        pthread_join(ch->engines[0].thread, NULL);
      }
      return -1;
    }
  }
  return 0;
}

void sim_engines_stop(sim_chip *ch) {
  pthread_mutex_lock(&ch->mu);
  ch->stop = 1;
  for (int i = 0; i < 2; i++) pthread_cond_signal(&ch->engines[i].cond);
  pthread_mutex_unlock(&ch->mu);
  for (int i = 0; i < 2; i++) {
    pthread_join(ch->engines[i].thread, NULL);
    pthread_cond_destroy(&ch->engines[i].cond);
    if (ch->engines[i].completion_fd >= 0) { /* the worker (its only writer) is gone */
      close(ch->engines[i].completion_fd);
      ch->engines[i].completion_fd = -1;
    }
  }
}

int sim_engine_completion_fd(sim_engine *e) {
  if (e->completion_fd < 0) e->completion_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  return e->completion_fd;
}
