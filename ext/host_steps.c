/* host_steps.c — multi-step greedy decode driven by the host (see host_steps.h). */
#include "host_steps.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct hs_run {
  pthread_mutex_t mu; /* held by the thread advancing the run */
  calrt_calbin *cb;
  calrt_engine engine;
  int32_t lanes, steps, vocab;
  int32_t k;         /* the step `cur` runs */
  int32_t submitted; /* steps submitted so far */
  int32_t ran;       /* the steps the run's lanes ran, at most: `steps`, or fewer once ended early */
  int short_;        /* a valid lane ran fewer steps than asked (an end token, hs_stop) */
  int64_t id;        /* the first step's job id: the run's */
  /* the step in flight's inputs; valid[l] is cleared once lane l ran its steps */
  int32_t *seq_ids, *tokens, *positions, *lane_steps, *step_tokens;
  uint8_t *valid;
  /* hs_start_ends: lane l's end tokens end_ids[end_off[l] .. end_off[l + 1]), from its step
   * end_from[l] on (NULL: none) */
  int32_t *end_off, *end_ids, *end_from;
  /* the run's outputs, per lane its last step's */
  float *logits;
  int64_t *echo;
  uint64_t *checksum;
  calrt_job *cur; /* the step in flight (NULL once finished) */
  calrt_job_status status;
  double device_us;
  atomic_int finished;
  atomic_int stop; /* hs_stop: end after the step in flight */
};

static int64_t now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* The first index of the row's largest value, a NaN counting as the largest (numpy's argmax). The
 * software runtime's on-device argmax (ext/calrt/sim/engine.c) is the device's own copy of the rule;
 * this one is the host's, in the binding, which builds against a vendor runtime too. The tests hold
 * the two equal: a host-driven run gives the device multi-step job's tokens bit for bit. */
static int32_t argmax_row(const float *row, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 0; i < n; i++) {
    if (row[i] != row[i]) return i; /* NaN */
    if (row[i] > row[best]) best = i;
  }
  return best;
}

void hs_free(hs_run *r) {
  if (!r) return;
  if (r->cur) calrt_job_release(r->cur);
  pthread_mutex_destroy(&r->mu);
  free(r->seq_ids); free(r->tokens); free(r->positions); free(r->lane_steps); free(r->step_tokens);
  free(r->valid); free(r->logits); free(r->echo); free(r->checksum);
  free(r->end_off); free(r->end_ids); free(r->end_from);
  free(r);
}

static calrt_status submit_step(hs_run *r) {
  calrt_job *job = NULL;
  calrt_status st = calrt_job_create_decode(r->cb, r->seq_ids, r->tokens, r->positions, r->valid, r->lanes, &job);
  if (st != CALRT_OK) return st;
  st = calrt_job_submit(job, r->engine);
  if (st != CALRT_OK) {
    calrt_job_release(job);
    return st;
  }
  r->cur = job;
  r->submitted++;
  return CALRT_OK;
}

/* Lane l's outputs from a step's result; `id`: the job id its echo names. */
static void take_lane(hs_run *r, const calrt_job_result *res, int32_t l, int64_t id) {
  memcpy(r->logits + (size_t)l * (size_t)r->vocab, res->logits + (size_t)l * (size_t)r->vocab,
         sizeof(float) * (size_t)r->vocab);
  r->echo[3 * l] = id;
  r->echo[3 * l + 1] = res->echo[3 * l + 1];
  r->echo[3 * l + 2] = res->echo[3 * l + 2];
  r->checksum[l] = res->checksum[l];
}

static void finish(hs_run *r, calrt_job_status st) {
  r->status = st;
  if (st != CALRT_JOB_OK) memset(r->step_tokens, 0, sizeof(int32_t) * (size_t)r->lanes * (size_t)r->steps);
  if (r->cur) {
    calrt_job_release(r->cur);
    r->cur = NULL;
  }
  atomic_store(&r->finished, 1);
}

/* Whether lane l of a step checks out: it echoes (the step's job, its sequence, its position) and its
 * row hashes to its checksum. */
static int lane_ok(const hs_run *r, const calrt_job_result *res, int32_t l) {
  const int64_t *e = res->echo + 3 * (size_t)l;
  if (e[0] != res->job_id || e[1] != r->seq_ids[l] || e[2] != r->positions[l]) return 0;
  const float *row = res->logits + (size_t)l * (size_t)res->vocab;
  return calrt_checksum(row, sizeof(float) * (size_t)res->vocab) == res->checksum[l];
}

/* The run ran `ran` < steps steps (mu held): the step tokens are compacted to [lanes, ran]. */
static void compact(hs_run *r, int32_t ran) {
  for (int32_t l = 1; l < r->lanes; l++) /* row l moves down to l * ran (never past its own start) */
    memmove(r->step_tokens + (size_t)l * (size_t)ran, r->step_tokens + (size_t)l * (size_t)r->steps,
            sizeof(int32_t) * (size_t)ran);
  r->ran = ran;
}

/* End the run after its step `ran - 1`, whose result is `res` (mu held): each lane still running
 * takes that step's outputs as its last. */
static void cut(hs_run *r, int32_t ran, const calrt_job_result *res) {
  for (int32_t l = 0; l < r->lanes; l++)
    if (r->valid[l]) {
      take_lane(r, res, l, r->id);
      r->valid[l] = 0;
      if (ran < r->lane_steps[l]) r->short_ = 1;
      r->lane_steps[l] = ran;
    }
}

/* Whether `tok`, lane l's token of step k, ends it (one of its end tokens, from its end_from on). */
static int ends_lane(const hs_run *r, int32_t l, int32_t k, int32_t tok) {
  if (!r->end_off || k < r->end_from[l]) return 0;
  for (int32_t i = r->end_off[l]; i < r->end_off[l + 1]; i++)
    if (r->end_ids[i] == tok) return 1;
  return 0;
}

/* The step in flight completed: take its outputs, then submit the next step or finish (mu held). */
static void step_done(hs_run *r) {
  calrt_job_result res;
  if (calrt_job_result_get(r->cur, &res) != CALRT_OK || res.lanes != r->lanes || res.vocab != r->vocab) {
    finish(r, CALRT_JOB_ABORTED); /* cannot happen with a conforming runtime */
    return;
  }
  if (res.device_us > 0) r->device_us += res.device_us;
  int bad = res.status != CALRT_JOB_OK;
  for (int32_t l = 0; l < r->lanes && !bad; l++)
    if (r->valid[l] && !lane_ok(r, &res, l)) bad = 1;
  const int32_t k = r->k, S = r->steps;
  if (bad) { /* the step's lanes report its outputs as they are (see host_steps.h) */
    for (int32_t l = 0; l < r->lanes; l++)
      if (r->valid[l] || k == 0) take_lane(r, &res, l, res.echo[3 * l]);
    finish(r, res.status);
    return;
  }
  int more = 0;
  for (int32_t l = 0; l < r->lanes; l++) {
    if (!r->valid[l]) {
      if (k == 0) take_lane(r, &res, l, r->id); /* an invalid lane: zeros, (id, -1, -1), 0 */
      continue;
    }
    const int32_t tok = argmax_row(res.logits + (size_t)l * (size_t)r->vocab, r->vocab);
    r->step_tokens[(size_t)l * (size_t)S + (size_t)k] = tok;
    const int end = k + 1 < r->lane_steps[l] && ends_lane(r, l, k, tok);
    if (end || k + 1 >= r->lane_steps[l]) { /* its last step */
      take_lane(r, &res, l, r->id);
      r->valid[l] = 0;
      if (end) {
        r->lane_steps[l] = k + 1;
        r->short_ = 1;
      }
    } else {
      r->tokens[l] = tok;
      r->positions[l] += 1;
      more = 1;
    }
  }
  if (more && atomic_load(&r->stop)) { /* stopped: every lane still running ends with this step */
    cut(r, k + 1, &res);
    more = 0;
  }
  if (!more && k + 1 < S) compact(r, k + 1); /* ended early: every lane ran its last step */
  calrt_job_release(r->cur); /* (after the last use of res: its buffers are the job's) */
  r->cur = NULL;
  if (!more) {
    finish(r, CALRT_JOB_OK);
    return;
  }
  r->k = k + 1;
  if (submit_step(r) != CALRT_OK) finish(r, CALRT_JOB_ABORTED); /* refused: a reset came between the steps */
}

calrt_status hs_start(calrt_calbin *cb, calrt_engine engine, const int32_t *seq_ids, const int32_t *tokens,
                      const int32_t *positions, const uint8_t *valid, int32_t lanes, int32_t steps,
                      const int32_t *lane_steps, hs_run **out) {
  return hs_start_ends(cb, engine, seq_ids, tokens, positions, valid, lanes, steps, lane_steps, NULL, NULL, NULL,
                       out);
}

calrt_status hs_start_ends(calrt_calbin *cb, calrt_engine engine, const int32_t *seq_ids, const int32_t *tokens,
                           const int32_t *positions, const uint8_t *valid, int32_t lanes, int32_t steps,
                           const int32_t *lane_steps, const int32_t *end_off, const int32_t *end_ids,
                           const int32_t *end_from, hs_run **out) {
  if (!cb || !seq_ids || !tokens || !positions || !valid || !out || lanes <= 0 || steps < 1 ||
      steps > CALRT_MAX_DECODE_STEPS)
    return CALRT_E_INVALID_ARGUMENT;
  for (int32_t l = 0; l < lanes; l++)
    if (valid[l] && lane_steps && (lane_steps[l] < 1 || lane_steps[l] > steps)) return CALRT_E_INVALID_ARGUMENT;
  if (end_off) {
    if (end_off[0] != 0) return CALRT_E_INVALID_ARGUMENT;
    for (int32_t l = 0; l < lanes; l++)
      if (end_off[l + 1] < end_off[l] || (end_from && end_from[l] < 0)) return CALRT_E_INVALID_ARGUMENT;
    if (end_off[lanes] > 0 && !end_ids) return CALRT_E_INVALID_ARGUMENT;
  }
  calrt_calbin_info info;
  calrt_status st = calrt_calbin_info_get(cb, &info);
  if (st != CALRT_OK) return st;
  hs_run *r = calloc(1, sizeof *r);
  if (!r) return CALRT_E_HOST_OOM;
  pthread_mutex_init(&r->mu, NULL);
  r->cb = cb;
  r->engine = engine;
  r->lanes = lanes;
  r->steps = steps;
  r->ran = steps;
  r->vocab = info.model.vocab_size;
  const size_t n = (size_t)lanes;
  r->seq_ids = malloc(sizeof(int32_t) * n);
  r->tokens = malloc(sizeof(int32_t) * n);
  r->positions = malloc(sizeof(int32_t) * n);
  r->lane_steps = malloc(sizeof(int32_t) * n);
  r->step_tokens = calloc(n * (size_t)steps, sizeof(int32_t));
  r->valid = malloc(n);
  r->logits = calloc(n * (size_t)r->vocab, sizeof(float));
  r->echo = calloc(3 * n, sizeof(int64_t));
  r->checksum = calloc(n, sizeof(uint64_t));
  if (!r->seq_ids || !r->tokens || !r->positions || !r->lane_steps || !r->step_tokens || !r->valid ||
      !r->logits || !r->echo || !r->checksum) {
    hs_free(r);
    return CALRT_E_HOST_OOM;
  }
  memcpy(r->seq_ids, seq_ids, sizeof(int32_t) * n);
  memcpy(r->tokens, tokens, sizeof(int32_t) * n);
  memcpy(r->positions, positions, sizeof(int32_t) * n);
  memcpy(r->valid, valid, n);
  for (size_t l = 0; l < n; l++) r->lane_steps[l] = !valid[l] ? 0 : lane_steps ? lane_steps[l] : steps;
  if (end_off) {
    const size_t m = (size_t)end_off[lanes];
    r->end_off = malloc(sizeof(int32_t) * (n + 1));
    r->end_ids = malloc(sizeof(int32_t) * (m ? m : 1));
    r->end_from = calloc(n, sizeof(int32_t));
    if (!r->end_off || !r->end_ids || !r->end_from) {
      hs_free(r);
      return CALRT_E_HOST_OOM;
    }
    memcpy(r->end_off, end_off, sizeof(int32_t) * (n + 1));
    if (m) memcpy(r->end_ids, end_ids, sizeof(int32_t) * m);
    if (end_from) memcpy(r->end_from, end_from, sizeof(int32_t) * n);
  }
  st = submit_step(r);
  if (st != CALRT_OK) {
    hs_free(r);
    return st;
  }
  r->id = calrt_job_id(r->cur);
  *out = r;
  return CALRT_OK;
}

calrt_status hs_wait(hs_run *r, int64_t timeout_us, calrt_job_status *status) {
  const int64_t deadline = timeout_us < 0 ? -1 : now_us() + timeout_us;
  pthread_mutex_lock(&r->mu);
  while (!atomic_load(&r->finished)) {
    int64_t left = -1;
    if (deadline >= 0) {
      left = deadline - now_us();
      if (left < 0) left = 0;
    }
    calrt_job_status js;
    const calrt_status st = calrt_job_wait(r->cur, left, &js);
    if (st == CALRT_E_TIMEOUT) {
      pthread_mutex_unlock(&r->mu);
      return st;
    }
    if (st != CALRT_OK) { /* the runtime refused the wait itself: cannot happen for a submitted job */
      finish(r, CALRT_JOB_ABORTED);
      break;
    }
    step_done(r);
  }
  pthread_mutex_unlock(&r->mu);
  if (status) *status = r->status;
  return CALRT_OK;
}

int hs_poll(hs_run *r) {
  if (atomic_load(&r->finished)) return 1;
  if (pthread_mutex_trylock(&r->mu) != 0) return 0; /* another thread drives it */
  while (!atomic_load(&r->finished) && calrt_job_done(r->cur)) step_done(r);
  pthread_mutex_unlock(&r->mu);
  return atomic_load(&r->finished);
}

calrt_status hs_result(hs_run *r, calrt_job_result *out, const int32_t **step_tokens) {
  if (!atomic_load(&r->finished)) return CALRT_E_INVALID_ARGUMENT;
  out->job_id = r->id;
  out->status = r->status;
  out->lanes = r->lanes;
  out->vocab = r->vocab;
  out->logits = r->logits;
  out->echo = r->echo;
  out->checksum = r->checksum;
  out->device_us = r->device_us;
  if (step_tokens) *step_tokens = r->step_tokens;
  return CALRT_OK;
}

int64_t hs_id(const hs_run *r) { return r->id; }

int32_t hs_steps(const hs_run *r) { return r->steps; }

int32_t hs_submitted(const hs_run *r) { return r->submitted; }

void hs_stop(hs_run *r) { atomic_store(&r->stop, 1); }

int32_t hs_steps_run(const hs_run *r) { return atomic_load(&r->finished) ? r->ran : r->steps; }

const int32_t *hs_lane_steps(const hs_run *r) { return atomic_load(&r->finished) ? r->lane_steps : NULL; }

int hs_short(const hs_run *r) { return atomic_load(&r->finished) && r->short_; }
