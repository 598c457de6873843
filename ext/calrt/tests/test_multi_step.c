/* Multi-step greedy decode (calrt_job_create_decode_steps, C3-style, sim-next only): run under
 * ASan/UBSan by `make asan-test` and under TSan by `make tsan-test` (a reset aborting jobs in flight).
 *
 * What it checks: an N-step job gives, lane by lane, the tokens and the last step's logits rows (bitwise)
 * that N single-step jobs with the argmax fed back give, also with per-lane step counts (lane_steps);
 * KV commit of each lane's steps; invalid lanes and
 * failed jobs all zeros; the argument refusals; CCU / crosstalk / hang-then-reset faults; null compute;
 * the timing model (N x decode_step_us); calrt-0.7.6's NOT_SUPPORTED. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define V 61 /* make_model's vocabulary */

/* The N-step job on B4 lanes {0, 1, 3} (lane 2 invalid) against single-step jobs on sequences
 * prefilled alike, twice in a row (the second job continues where the first committed). per_lane:
 * lane 1 runs 1 step and lane 3 steps - 1 (lane_steps), lane 0 all of them. */
static void equivalence(calrt_device *dev, test_model *tm, int steps, int per_lane) {
  calrt_calbin *cb = test_calbin(dev, tm, 4, 40, 8, 0);
  const int32_t prompts[3][4] = {{3, 9, 27, 20}, {5, 1, 50, 7}, {60, 2, 2, 11}};
  const int lane_of[3] = {0, 1, 3};
  int32_t ms[3], rs[3], tok_m[4] = {0}, tok_r[4] = {0}, pos[4] = {0}, sm[4] = {-1, -1, -1, -1},
          sr[4] = {-1, -1, -1, -1};
  uint8_t valid[4] = {0};
  for (int i = 0; i < 3; i++) {
    int L = lane_of[i];
    ms[i] = test_prefilled(cb, prompts[i], 4, &tok_m[L]);
    rs[i] = test_prefilled(cb, prompts[i], 4, &tok_r[L]);
    CHECK(tok_m[L] == tok_r[L]);
    sm[L] = ms[i];
    sr[L] = rs[i];
    pos[L] = 4;
    valid[L] = 1;
  }
  int32_t ls[4] = {steps, per_lane ? 1 : steps, 0, per_lane ? steps - 1 : steps};
  for (int round = 0; round < 2; round++) {
    calrt_job *j;
    calrt_job_result r;
    const int32_t *st_tok;
    int32_t st_n = 0;
    CHECK(calrt_job_create_decode_steps(cb, sm, tok_m, pos, valid, 4, steps, per_lane ? ls : NULL, &j) == CALRT_OK);
    CHECK(calrt_job_step_tokens(j, &st_tok, &st_n) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("has not completed"));
    CHECK(run(j, CALRT_ENGINE_PONG) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK && r.lanes == 4 && r.vocab == V);
    CHECK(calrt_job_step_tokens(j, &st_tok, &st_n) == CALRT_OK && st_n == steps);
    /* the reference: one single-step job per step, the argmax fed back */
    float last[4][V];
    int32_t want[4][64];
    for (int k = 0; k < steps; k++) {
      int32_t p[4];
      uint8_t on[4];
      for (int l = 0; l < 4; l++) {
        p[l] = pos[l] + k;
        on[l] = valid[l] && k < ls[l]; /* the reference runs each lane its own steps */
      }
      calrt_job *rj;
      calrt_job_result rr;
      CHECK(calrt_job_create_decode(cb, sr, tok_r, p, on, 4, &rj) == CALRT_OK);
      CHECK(run(rj, CALRT_ENGINE_PING) == CALRT_JOB_OK);
      CHECK(calrt_job_result_get(rj, &rr) == CALRT_OK);
      for (int l = 0; l < 4; l++) {
        if (!on[l]) continue;
        want[l][k] = tok_r[l] = argmax(rr.logits + (size_t)l * V, V);
        if (k == ls[l] - 1) memcpy(last[l], rr.logits + (size_t)l * V, sizeof last[l]);
      }
      calrt_job_release(rj);
    }
    for (int l = 0; l < 4; l++) {
      if (!valid[l]) { /* invalid lane: zeros, echo (job, -1, -1) */
        for (int k = 0; k < steps; k++) CHECK(st_tok[l * steps + k] == 0);
        CHECK(r.echo[3 * l + 1] == -1 && r.echo[3 * l + 2] == -1 && r.checksum[l] == 0);
        continue;
      }
      const int n = ls[l];
      for (int k = 0; k < steps; k++) CHECK(st_tok[l * steps + k] == (k < n ? want[l][k] : 0));
      CHECK(memcmp(r.logits + (size_t)l * V, last[l], sizeof last[l]) == 0);
      CHECK(r.echo[3 * l] == r.job_id && r.echo[3 * l + 1] == sm[l] && r.echo[3 * l + 2] == pos[l] + n - 1);
      CHECK(r.checksum[l] == calrt_checksum(r.logits + (size_t)l * V, sizeof(float) * V));
      CHECK(st_tok[l * steps + n - 1] == argmax(r.logits + (size_t)l * V, V));
      int32_t len;
      CHECK(calrt_kv_committed_len(cb, sm[l], &len) == CALRT_OK && len == pos[l] + n);
      tok_m[l] = st_tok[l * steps + n - 1];
    }
    calrt_job_release(j);
    for (int l = 0; l < 4; l++)
      if (valid[l]) pos[l] += ls[l];
  }
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

static void refusals_and_faults(calrt_device *dev, test_model *tm) {
  calrt_calbin *cb = test_calbin(dev, tm, 1, 24, 8, 0);
  const int32_t prompt[3] = {7, 8, 9};
  int32_t first, len;
  int32_t s = test_prefilled(cb, prompt, 3, &first);
  int32_t pos = 3;
  uint8_t one = 1;
  calrt_job *j = NULL;
  calrt_job_result r;
  const int32_t *st_tok;
  int32_t st_n;
  calrt_job_status st;
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 0, NULL, &j) == CALRT_E_INVALID_ARGUMENT &&
        ERR_HAS("steps"));
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, CALRT_MAX_DECODE_STEPS + 1, NULL, &j) ==
            CALRT_E_INVALID_ARGUMENT && ERR_HAS("steps"));
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 22, NULL, &j) == CALRT_E_INVALID_ARGUMENT &&
        ERR_HAS("exceed max_seq"));
  int32_t bad_ls = 3;
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 2, &bad_ls, &j) == CALRT_E_INVALID_ARGUMENT &&
        ERR_HAS("lane_steps[0]"));
  bad_ls = 0;
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 2, &bad_ls, &j) == CALRT_E_INVALID_ARGUMENT &&
        ERR_HAS("lane_steps[0]"));
  CHECK(j == NULL);
  /* 21 steps from position 3 fill max_seq 24 exactly */
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 21, NULL, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  CHECK(calrt_job_step_tokens(j, &st_tok, &st_n) == CALRT_OK && st_n == 21);
  calrt_job_release(j);
  CHECK(calrt_kv_committed_len(cb, s, &len) == CALRT_OK && len == 24);
  CHECK(calrt_kv_remove_tokens_at_end(cb, s, 21) == CALRT_OK);
  /* a plain decode has no step tokens */
  CHECK(calrt_job_create_decode(cb, &s, &first, &pos, &one, 1, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  CHECK(calrt_job_step_tokens(j, &st_tok, &st_n) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("not a multi-step"));
  calrt_job_release(j);
  CHECK(calrt_kv_remove_tokens_at_end(cb, s, 1) == CALRT_OK);
  /* INVALID at execution (position != committed_len): nothing committed */
  int32_t wrong = 2;
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &wrong, &one, 1, 4, NULL, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_INVALID);
  CHECK(calrt_job_step_tokens(j, &st_tok, &st_n) == CALRT_OK);
  for (int k = 0; k < 4; k++) CHECK(st_tok[k] == 0);
  calrt_job_release(j);
  CHECK(calrt_kv_committed_len(cb, s, &len) == CALRT_OK && len == 3);
  /* Crosstalk: the last row no longer hashes to its checksum; the commit stands. */
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_CROSSTALK, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 3, NULL, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
  CHECK(calrt_checksum(r.logits, sizeof(float) * V) != r.checksum[0]);
  calrt_job_release(j);
  CHECK(calrt_kv_committed_len(cb, s, &len) == CALRT_OK && len == 6);
  CHECK(calrt_kv_remove_tokens_at_end(cb, s, 3) == CALRT_OK);
  /* A hung job holds its sequence; a reset aborts it: zeros, nothing committed, sequence invalid. */
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_TIMEOUT, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 5, NULL, &j) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PING) == CALRT_OK);
  CHECK(calrt_job_wait(j, 20000, &st) == CALRT_E_TIMEOUT);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_E_IN_USE);
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
  CHECK(calrt_job_wait(j, -1, &st) == CALRT_OK && st == CALRT_JOB_ABORTED);
  CHECK(calrt_job_step_tokens(j, &st_tok, &st_n) == CALRT_OK && st_n == 5);
  for (int k = 0; k < 5; k++) CHECK(st_tok[k] == 0);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK && r.checksum[0] == 0);
  calrt_job_release(j);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  /* CCU fault: the sequence unknown, zeros, the chip faulted until reset. */
  s = test_prefilled(cb, prompt, 3, &first);
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PONG, CALRT_SIM_FAULT_CCU, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 6, NULL, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PONG) == CALRT_JOB_CCU_FAULT);
  CHECK(calrt_job_step_tokens(j, &st_tok, &st_n) == CALRT_OK);
  for (int k = 0; k < 6; k++) CHECK(st_tok[k] == 0);
  calrt_job_release(j);
  CHECK(calrt_kv_committed_len(cb, s, &len) == CALRT_E_SEQUENCE_INVALID);
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

/* The timing model: a 6-step job at 3 ms a step has the device for >= 18 ms. */
static void timing(calrt_device *dev, test_model *tm) {
  calrt_calbin *cb = test_calbin(dev, tm, 1, 24, 8, 3000.0);
  const int32_t prompt[2] = {1, 2};
  int32_t first, pos = 2;
  uint8_t one = 1;
  int32_t s = test_prefilled(cb, prompt, 2, &first);
  calrt_job *j;
  calrt_job_result r;
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 6, NULL, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK && r.device_us >= 18000.0);
  calrt_job_release(j);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

/* Jobs in flight on both engines while another thread resets the chip: every job completes exactly
 * once (OK, ABORTED, or INVALID when a reset came before it), an OK one committed its steps (TSan's case). */
typedef struct { calrt_device *dev; atomic_int stop; } resetter_arg;

static void *resetter(void *p) {
  resetter_arg *a = p;
  unsigned k = 1;
  while (!atomic_load(&a->stop)) {
    k = k * 1103515245u + 12345u;
    struct timespec ts = {0, (long)(500 + (k >> 16) % 6000) * 1000}; /* 0.5-6.5 ms */
    nanosleep(&ts, NULL);
    CHECK(calrt_device_reset(a->dev, 0) == CALRT_OK);
  }
  return NULL;
}

static void resets(calrt_device *dev, test_model *tm) {
  calrt_calbin *cb = test_calbin(dev, tm, 2, 400, 8, 200.0);
  resetter_arg a;
  a.dev = dev;
  atomic_init(&a.stop, 0);
  pthread_t th;
  CHECK(pthread_create(&th, NULL, resetter, &a) == 0);
  int ok = 0, aborted = 0;
  for (int round = 0; round < 40; round++) {
    const int32_t prompt[2] = {4, 5};
    int32_t s[2], tok[2], pos[2] = {2, 2}, len;
    uint8_t valid[2] = {1, 1};
    int failed = 0;
    for (int l = 0; l < 2; l++) {
      calrt_job *pj;
      calrt_job_status st;
      CHECK(calrt_kv_create_sequence(cb, &s[l]) == CALRT_OK);
      CHECK(calrt_job_create_prefill(cb, s[l], prompt, 2, &pj) == CALRT_OK);
      if (calrt_job_submit(pj, CALRT_ENGINE_PING) != CALRT_OK) failed = 1;
      else if (calrt_job_wait(pj, -1, &st) != CALRT_OK || st != CALRT_JOB_OK) failed = 1;
      tok[l] = 0;
      calrt_job_release(pj);
    }
    if (!failed) {
      calrt_job *j;
      calrt_job_status st;
      CHECK(calrt_job_create_decode_steps(cb, s, tok, pos, valid, 2, 8, NULL, &j) == CALRT_OK);
      if (calrt_job_submit(j, round % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_OK) {
        CHECK(calrt_job_wait(j, -1, &st) == CALRT_OK);
        if (st == CALRT_JOB_OK) {
          ok++;
          /* a reset after the completion may have invalidated it since: only a valid one is read */
          calrt_status ls = calrt_kv_committed_len(cb, s[0], &len);
          CHECK(ls == CALRT_E_SEQUENCE_INVALID || (ls == CALRT_OK && len == 10));
        } else {
          /* aborted in flight, or INVALID: a reset between the prefill and this job */
          CHECK(st == CALRT_JOB_ABORTED || st == CALRT_JOB_INVALID);
          aborted++;
        }
      }
      calrt_job_release(j);
    }
    for (int l = 0; l < 2; l++) CHECK(calrt_kv_free_sequence(cb, s[l]) == CALRT_OK);
  }
  atomic_store(&a.stop, 1);
  CHECK(pthread_join(th, NULL) == 0);
  fprintf(stderr, "multi-step under resets: %d OK, %d aborted\n", ok, aborted);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

int main(void) {
  test_model tm;
  make_model(&tm, 0);
  calrt_open_params op = {.profile = "sim-next", .dram_bytes = 64u << 20};
  calrt_device *dev;
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  calrt_device_info di;
  CHECK(calrt_device_info_get(dev, &di) == CALRT_OK && di.multi_step == 1);
  equivalence(dev, &tm, 1 + 1, 0);
  equivalence(dev, &tm, 7, 0);
  equivalence(dev, &tm, 5, 1);
  refusals_and_faults(dev, &tm);
  timing(dev, &tm);
  resets(dev, &tm);
  CHECK(calrt_device_close(dev) == CALRT_OK);

  /* Null compute: the same equivalence over the pseudo-logits. */
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  CHECK(calrt_sim_configure(dev, 1, 0, 0) == CALRT_OK);
  test_model none;
  memset(&none, 0, sizeof none);
  none.m = tm.m;
  equivalence(dev, &none, 5, 0);
  equivalence(dev, &none, 4, 1);
  CHECK(calrt_device_close(dev) == CALRT_OK);

  /* calrt-0.7.6: no multi-step decode (one step still goes). */
  calrt_open_params old = {.profile = "calrt-0.7.6", .dram_bytes = 64u << 20};
  CHECK(calrt_device_open(&old, &dev) == CALRT_OK);
  CHECK(calrt_device_info_get(dev, &di) == CALRT_OK && di.multi_step == 0);
  calrt_calbin *cb = test_calbin(dev, &tm, 1, 24, 8, 0);
  const int32_t prompt[2] = {1, 2};
  int32_t first, pos = 2;
  uint8_t one = 1;
  int32_t s = test_prefilled(cb, prompt, 2, &first);
  calrt_job *j = NULL;
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 2, NULL, &j) == CALRT_E_NOT_SUPPORTED &&
        ERR_HAS("multi-step") && j == NULL);
  CHECK(calrt_job_create_decode_steps(cb, &s, &first, &pos, &one, 1, 1, NULL, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  calrt_job_release(j);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  free_model(&tm);
  fprintf(stderr, "test_multi_step: OK\n");
  return 0;
}
