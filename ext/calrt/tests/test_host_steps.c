/* Host-driven multi-step decode (../../host_steps.c, the binding's runs over calrt.h's core API):
 * run under ASan/UBSan by `make asan-test` and under TSan by `make tsan-test`.
 *
 * What it checks: a run gives, lane by lane, exactly what the device's own multi-step job gives
 * (sim-next: the same step tokens, the same last rows bitwise, the same echo positions and
 * checksums, the same commits), also with per-lane step counts, and the same as single steps on
 * calrt-0.7.6, which has no multi-step of its own; one device job a step; the run's failures (a CCU
 * fault, a crosstalk, a refused submit, a hang ended by a reset from another thread); hs_poll
 * driving a run alone and beside a thread blocked in hs_wait (TSan's case); hs_stop: a run stopped
 * after its m-th step gives what a run of m steps gives (each lane min(its steps, m)), also from
 * another thread while one waits; hs_start_ends: lanes that end on their end tokens. */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "common.h"
#include "host_steps.h"

#define V 61 /* make_model's vocabulary */

static uint64_t submitted(calrt_device *dev, calrt_engine e) {
  calrt_counters c;
  CHECK(calrt_engine_counters(dev, 0, e, &c) == CALRT_OK);
  return c.submitted;
}

/* The reference of lane l: single-step jobs with the argmax fed back (each lane its own steps). */
static void reference(calrt_calbin *cb, int B, const int32_t *sr, int32_t *tok, const int32_t *pos,
                      const uint8_t *valid, const int32_t *ls, int steps, int32_t want[4][64], float last[4][V]) {
  for (int k = 0; k < steps; k++) {
    int32_t p[4];
    uint8_t on[4];
    for (int l = 0; l < B; l++) {
      p[l] = pos[l] + k;
      on[l] = valid[l] && k < ls[l];
    }
    calrt_job *rj;
    calrt_job_result rr;
    CHECK(calrt_job_create_decode(cb, sr, tok, p, on, B, &rj) == CALRT_OK);
    CHECK(run(rj, CALRT_ENGINE_PING) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(rj, &rr) == CALRT_OK);
    for (int l = 0; l < B; l++) {
      if (!on[l]) continue;
      want[l][k] = tok[l] = argmax(rr.logits + (size_t)l * V, V);
      if (k == ls[l] - 1) memcpy(last[l], rr.logits + (size_t)l * V, sizeof(float) * V);
    }
    calrt_job_release(rj);
  }
}

/* A finished run's outputs (r, its step tokens [B lanes, cols]) are those of each valid lane l running
 * n[l] steps from pos[l] on its sequence sh[l], against the single-step reference (want, last): its
 * tokens then zeros, its last row bitwise, the echo (the run's id, its sequence, its last position),
 * the checksum and the KV committed; an invalid lane's tokens all zero. */
static void check_lanes(calrt_calbin *cb, const calrt_job_result *r, const int32_t *st_tok, int B, int cols,
                        const int32_t *sh, const int32_t *pos, const uint8_t *valid, const int32_t *n,
                        int32_t want[4][64], float last[4][V]) {
  for (int l = 0; l < B; l++) {
    if (!valid[l]) {
      for (int k = 0; k < cols; k++) CHECK(st_tok[l * cols + k] == 0);
      continue;
    }
    for (int k = 0; k < cols; k++) CHECK(st_tok[l * cols + k] == (k < n[l] ? want[l][k] : 0));
    CHECK(memcmp(r->logits + (size_t)l * V, last[l], sizeof(float) * V) == 0);
    CHECK(r->echo[3 * l] == r->job_id && r->echo[3 * l + 1] == sh[l] && r->echo[3 * l + 2] == pos[l] + n[l] - 1);
    CHECK(r->checksum[l] == calrt_checksum(r->logits + (size_t)l * V, sizeof(float) * V));
    int32_t len;
    CHECK(calrt_kv_committed_len(cb, sh[l], &len) == CALRT_OK && len == pos[l] + n[l]);
  }
}

/* B4 lanes {0, 1, 3} (lane 2 invalid; B1: lane 0), twice in a row: the run against single steps, and
 * on a device with multi_step against its own multi-step job too. per_lane: lane 1 runs 1 step, lane
 * 3 steps - 1 (B1: its one lane all of them). */
static void equivalence(calrt_device *dev, test_model *tm, int B, int steps, int per_lane, int device_multi) {
  calrt_calbin *cb = test_calbin(dev, tm, B, 48, 16, 0);
  const int32_t prompts[3][4] = {{3, 9, 27, 20}, {5, 1, 50, 7}, {60, 2, 2, 11}};
  const int lane_of[3] = {0, 1, 3}, used = B == 4 ? 3 : 1;
  int32_t sh[4] = {-1, -1, -1, -1}, sr[4] = {-1, -1, -1, -1}, sd[4] = {-1, -1, -1, -1};
  int32_t tok_h[4] = {0}, tok_r[4] = {0}, tok_d[4] = {0}, pos[4] = {0};
  uint8_t valid[4] = {0};
  for (int i = 0; i < used; i++) {
    const int L = lane_of[i];
    sh[L] = test_prefilled(cb, prompts[i], 4, &tok_h[L]);
    sr[L] = test_prefilled(cb, prompts[i], 4, &tok_r[L]);
    if (device_multi) sd[L] = test_prefilled(cb, prompts[i], 4, &tok_d[L]);
    pos[L] = 4;
    valid[L] = 1;
  }
  int32_t ls[4] = {steps, per_lane ? 1 : steps, 0, per_lane ? steps - 1 : steps};
  int most = 0;
  for (int l = 0; l < B; l++)
    if (valid[l] && ls[l] > most) most = ls[l];
  for (int round = 0; round < 2; round++) {
    hs_run *h = NULL;
    calrt_job_result r;
    const int32_t *st_tok;
    calrt_job_status st;
    const uint64_t before = submitted(dev, CALRT_ENGINE_PONG);
    CHECK(hs_start(cb, CALRT_ENGINE_PONG, sh, tok_h, pos, valid, B, steps, per_lane ? ls : NULL, &h) == CALRT_OK);
    CHECK(hs_result(h, &r, &st_tok) == CALRT_E_INVALID_ARGUMENT); /* not finished yet */
    CHECK(hs_wait(h, -1, &st) == CALRT_OK && st == CALRT_JOB_OK);
    CHECK(hs_submitted(h) == most && submitted(dev, CALRT_ENGINE_PONG) - before == (uint64_t)most);
    CHECK(hs_result(h, &r, &st_tok) == CALRT_OK && r.lanes == B && r.vocab == V && r.job_id == hs_id(h));
    int32_t want[4][64];
    float last[4][V];
    reference(cb, B, sr, tok_r, pos, valid, ls, steps, want, last);
    check_lanes(cb, &r, st_tok, B, steps, sh, pos, valid, ls, want, last);
    for (int l = 0; l < B; l++) {
      if (!valid[l]) { /* an invalid lane: (run, -1, -1), checksum 0 */
        CHECK(r.echo[3 * l] == r.job_id && r.echo[3 * l + 1] == -1 && r.echo[3 * l + 2] == -1 && r.checksum[l] == 0);
        continue;
      }
      tok_h[l] = st_tok[l * steps + ls[l] - 1];
    }
    if (device_multi) { /* the device's own multi-step job: the same outputs */
      calrt_job *j;
      calrt_job_result d;
      const int32_t *dt;
      int32_t dn;
      CHECK(calrt_job_create_decode_steps(cb, sd, tok_d, pos, valid, B, steps, per_lane ? ls : NULL, &j) == CALRT_OK);
      CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
      CHECK(calrt_job_result_get(j, &d) == CALRT_OK && calrt_job_step_tokens(j, &dt, &dn) == CALRT_OK);
      CHECK(memcmp(dt, st_tok, sizeof(int32_t) * (size_t)B * (size_t)steps) == 0);
      CHECK(memcmp(d.logits, r.logits, sizeof(float) * (size_t)B * V) == 0);
      CHECK(memcmp(d.checksum, r.checksum, sizeof(uint64_t) * (size_t)B) == 0);
      for (int l = 0; l < B; l++) CHECK(d.echo[3 * l + 2] == r.echo[3 * l + 2]);
      for (int l = 0; l < B; l++)
        if (valid[l]) tok_d[l] = dt[l * steps + ls[l] - 1];
      calrt_job_release(j);
    }
    hs_free(h);
    for (int l = 0; l < B; l++)
      if (valid[l]) pos[l] += ls[l];
  }
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

/* A run's failures end it at the step that failed. */
static void faults(calrt_device *dev, test_model *tm) {
  calrt_calbin *cb = test_calbin(dev, tm, 1, 48, 16, 0);
  const int32_t prompt[3] = {7, 8, 9};
  int32_t first, len, pos = 3;
  uint8_t one = 1;
  hs_run *h;
  calrt_job_result r;
  const int32_t *st_tok;
  calrt_job_status st;
  int32_t s = test_prefilled(cb, prompt, 3, &first);
  /* the step counts are checked */
  int32_t bad = 0;
  CHECK(hs_start(cb, CALRT_ENGINE_PING, &s, &first, &pos, &one, 1, 0, NULL, &h) == CALRT_E_INVALID_ARGUMENT);
  CHECK(hs_start(cb, CALRT_ENGINE_PING, &s, &first, &pos, &one, 1, 2, &bad, &h) == CALRT_E_INVALID_ARGUMENT);
  bad = 3;
  CHECK(hs_start(cb, CALRT_ENGINE_PING, &s, &first, &pos, &one, 1, 2, &bad, &h) == CALRT_E_INVALID_ARGUMENT);
  /* a CCU fault at the third step: that status, every token zero, three steps submitted */
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_CCU, 3, 0) == CALRT_OK);
  CHECK(hs_start(cb, CALRT_ENGINE_PING, &s, &first, &pos, &one, 1, 6, NULL, &h) == CALRT_OK);
  CHECK(hs_wait(h, -1, &st) == CALRT_OK && st == CALRT_JOB_CCU_FAULT && hs_submitted(h) == 3);
  CHECK(hs_result(h, &r, &st_tok) == CALRT_OK && r.status == CALRT_JOB_CCU_FAULT);
  for (int k = 0; k < 6; k++) CHECK(st_tok[k] == 0);
  hs_free(h);
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  /* a crosstalk at the second step: the run stops there, OK, and its row names that step's job
   * (not the run) and position (not the last one's): the host's own check finds the lane */
  s = test_prefilled(cb, prompt, 3, &first);
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_CROSSTALK, 2, 0) == CALRT_OK);
  CHECK(hs_start(cb, CALRT_ENGINE_PING, &s, &first, &pos, &one, 1, 5, NULL, &h) == CALRT_OK);
  CHECK(hs_wait(h, -1, &st) == CALRT_OK && st == CALRT_JOB_OK && hs_submitted(h) == 2);
  CHECK(hs_result(h, &r, &st_tok) == CALRT_OK);
  CHECK(r.echo[0] != r.job_id && r.echo[2] == pos + 1);
  CHECK(calrt_checksum(r.logits, sizeof(float) * V) != r.checksum[0]);
  hs_free(h);
  CHECK(calrt_kv_committed_len(cb, s, &len) == CALRT_OK && len == pos + 2);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  /* a submit refused at the second step: ABORTED, one step run */
  s = test_prefilled(cb, prompt, 3, &first);
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PONG, CALRT_SIM_FAULT_BUSY, 2, 0) == CALRT_OK);
  CHECK(hs_start(cb, CALRT_ENGINE_PONG, &s, &first, &pos, &one, 1, 4, NULL, &h) == CALRT_OK);
  CHECK(hs_wait(h, -1, &st) == CALRT_OK && st == CALRT_JOB_ABORTED && hs_submitted(h) == 1);
  hs_free(h);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  /* a hang: a timed-out wait leaves the run in flight; a reset ends it ABORTED */
  s = test_prefilled(cb, prompt, 3, &first);
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_TIMEOUT, 2, 0) == CALRT_OK);
  CHECK(hs_start(cb, CALRT_ENGINE_PING, &s, &first, &pos, &one, 1, 4, NULL, &h) == CALRT_OK);
  CHECK(hs_wait(h, 20000, &st) == CALRT_E_TIMEOUT && !hs_poll(h) && hs_submitted(h) == 2);
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
  CHECK(hs_wait(h, -1, &st) == CALRT_OK && st == CALRT_JOB_ABORTED && hs_poll(h));
  hs_free(h);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  /* freed while a step is in flight: nothing further is submitted */
  s = test_prefilled(cb, prompt, 3, &first);
  const uint64_t before = submitted(dev, CALRT_ENGINE_PING);
  CHECK(hs_start(cb, CALRT_ENGINE_PING, &s, &first, &pos, &one, 1, 8, NULL, &h) == CALRT_OK);
  hs_free(h);
  struct timespec ts = {0, 5 * 1000 * 1000};
  nanosleep(&ts, NULL);
  CHECK(submitted(dev, CALRT_ENGINE_PING) - before == 1);
  while (calrt_kv_free_sequence(cb, s) == CALRT_E_IN_USE) nanosleep(&ts, NULL);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

/* hs_poll alone drives a run to its end, and beside a thread blocked in hs_wait it never blocks nor
 * advances the run twice (TSan's case), on a timed device while another thread resets it. */
typedef struct {
  hs_run *h;
  calrt_job_status st;
} waiter_arg;

static void *waiter(void *p) {
  waiter_arg *a = p;
  CHECK(hs_wait(a->h, -1, &a->st) == CALRT_OK);
  return NULL;
}

static void polling(calrt_device *dev, test_model *tm) {
  calrt_calbin *cb = test_calbin(dev, tm, 2, 400, 16, 1000.0);
  int ok = 0, failed = 0;
  for (int round = 0; round < 30; round++) {
    const int32_t prompt[2] = {4, 5};
    int32_t s[2], tok[2], pos[2] = {2, 2};
    uint8_t valid[2] = {1, 1};
    for (int l = 0; l < 2; l++) s[l] = test_prefilled(cb, prompt, 2, &tok[l]);
    hs_run *h;
    CHECK(hs_start(cb, round % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING, s, tok, pos, valid, 2, 6, NULL, &h) ==
          CALRT_OK);
    if (round % 3 == 0) { /* polled alone */
      struct timespec ts = {0, 100 * 1000};
      while (!hs_poll(h)) nanosleep(&ts, NULL);
    } else { /* a waiter thread, polled meanwhile, sometimes reset under it */
      waiter_arg a = {h, CALRT_JOB_INVALID};
      pthread_t th;
      CHECK(pthread_create(&th, NULL, waiter, &a) == 0);
      for (int i = 0; i < 20; i++) {
        hs_poll(h);
        struct timespec ts = {0, 50 * 1000};
        nanosleep(&ts, NULL);
      }
      if (round % 3 == 2) CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
      CHECK(pthread_join(th, NULL) == 0);
      CHECK(hs_poll(h));
    }
    calrt_job_result r;
    const int32_t *st_tok;
    CHECK(hs_result(h, &r, &st_tok) == CALRT_OK);
    if (r.status == CALRT_JOB_OK) {
      ok++;
      CHECK(hs_submitted(h) == 6);
      int32_t len;
      for (int l = 0; l < 2; l++) { /* a reset after the run may have invalidated it since */
        const calrt_status ls = calrt_kv_committed_len(cb, s[l], &len);
        CHECK(ls == CALRT_E_SEQUENCE_INVALID || (ls == CALRT_OK && len == 8));
      }
    } else {
      CHECK(r.status == CALRT_JOB_ABORTED || r.status == CALRT_JOB_INVALID);
      failed++;
    }
    hs_free(h);
    for (int l = 0; l < 2; l++) CHECK(calrt_kv_free_sequence(cb, s[l]) == CALRT_OK);
  }
  CHECK(ok >= 10);
  fprintf(stderr, "host-driven runs polled: %d OK, %d ended by a reset\n", ok, failed);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

/* hs_stop: the run ends with the step in flight; its outputs are an m-step run's. */
static void stopping(calrt_device *dev, test_model *tm) {
  calrt_calbin *cb = test_calbin(dev, tm, 4, 64, 16, 0);
  const int32_t prompts[3][4] = {{3, 9, 27, 20}, {5, 1, 50, 7}, {60, 2, 2, 11}};
  const int lane_of[3] = {0, 1, 3}, S = 8;
  /* stopped after step `at` (driven by hs_poll up to there: nobody else advances it), at 0: before
   * the first step completed; at S: after it finished (no effect) */
  const int ats[4] = {3, 1, 0, S};
  for (int t = 0; t < 4; t++) {
    int32_t sh[4] = {-1, -1, -1, -1}, sr[4] = {-1, -1, -1, -1}, tok_h[4] = {0}, tok_r[4] = {0}, pos[4] = {0};
    uint8_t valid[4] = {0};
    for (int i = 0; i < 3; i++) {
      const int L = lane_of[i];
      sh[L] = test_prefilled(cb, prompts[i], 4, &tok_h[L]);
      sr[L] = test_prefilled(cb, prompts[i], 4, &tok_r[L]);
      pos[L] = 4;
      valid[L] = 1;
    }
    int32_t ls[4] = {S, 2, 0, S - 1}; /* lane 1 ends after 2 steps by itself */
    hs_run *h;
    calrt_job_status st;
    CHECK(hs_start(cb, CALRT_ENGINE_PING, sh, tok_h, pos, valid, 4, S, ls, &h) == CALRT_OK);
    struct timespec ts = {0, 20 * 1000};
    if (ats[t] == S)
      CHECK(hs_wait(h, -1, &st) == CALRT_OK);
    else
      while (ats[t] > 0 && hs_submitted(h) < ats[t] && !hs_poll(h)) nanosleep(&ts, NULL);
    hs_stop(h);
    const int m = hs_submitted(h); /* the step in flight is the last (nobody drives it meanwhile) */
    CHECK(hs_wait(h, -1, &st) == CALRT_OK && st == CALRT_JOB_OK && hs_submitted(h) == m);
    CHECK(hs_steps(h) == S && hs_steps_run(h) == (ats[t] == S ? S : m));
    if (ats[t] == 0) CHECK(m == 1);
    const int ran = hs_steps_run(h);
    calrt_job_result r;
    const int32_t *st_tok;
    CHECK(hs_result(h, &r, &st_tok) == CALRT_OK);
    int32_t cut[4], want[4][64];
    float last[4][V];
    for (int l = 0; l < 4; l++) cut[l] = ls[l] < ran ? ls[l] : ran;
    reference(cb, 4, sr, tok_r, pos, valid, cut, ran, want, last);
    check_lanes(cb, &r, st_tok, 4, ran, sh, pos, valid, cut, want, last);
    hs_free(h);
    for (int l = 0; l < 4; l++)
      if (valid[l]) {
        CHECK(calrt_kv_free_sequence(cb, sh[l]) == CALRT_OK);
        CHECK(calrt_kv_free_sequence(cb, sr[l]) == CALRT_OK);
      }
  }
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
  /* stopped from another thread while one waits, on a timed device (TSan's case) */
  cb = test_calbin(dev, tm, 2, 400, 16, 500.0);
  int cuts = 0;
  for (int round = 0; round < 12; round++) {
    const int32_t prompt[2] = {4, 5};
    int32_t s[2], tok[2], pos[2] = {2, 2};
    uint8_t valid[2] = {1, 1};
    for (int l = 0; l < 2; l++) s[l] = test_prefilled(cb, prompt, 2, &tok[l]);
    hs_run *h;
    CHECK(hs_start(cb, CALRT_ENGINE_PONG, s, tok, pos, valid, 2, 16, NULL, &h) == CALRT_OK);
    waiter_arg a = {h, CALRT_JOB_INVALID};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, waiter, &a) == 0);
    struct timespec ts = {0, (long)(round % 4) * 600 * 1000};
    nanosleep(&ts, NULL);
    hs_stop(h);
    CHECK(pthread_join(th, NULL) == 0);
    CHECK(a.st == CALRT_JOB_OK);
    const int ran = hs_steps_run(h);
    CHECK(ran >= 1 && ran <= 16 && ran == hs_submitted(h));
    cuts += ran < 16;
    int32_t len;
    for (int l = 0; l < 2; l++) CHECK(calrt_kv_committed_len(cb, s[l], &len) == CALRT_OK && len == 2 + ran);
    hs_free(h);
    for (int l = 0; l < 2; l++) CHECK(calrt_kv_free_sequence(cb, s[l]) == CALRT_OK);
  }
  CHECK(cuts >= 6);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

/* hs_start_ends: a lane ends on its first end token from its end_from on (its steps, KV and outputs
 * are a run of that many steps'); the run ends once no lane runs, with the step tokens compacted to
 * the steps it ran. */
static void ending(calrt_device *dev, test_model *tm) {
  calrt_calbin *cb = test_calbin(dev, tm, 4, 64, 16, 0);
  const int32_t prompts[3][4] = {{3, 9, 27, 20}, {5, 1, 50, 7}, {60, 2, 2, 11}};
  const int lane_of[3] = {0, 1, 3}, S = 8;
  /* the arguments are checked */
  {
    int32_t s = 0, t = 0, p = 0, off[2] = {1, 1}, ids[1] = {0}, from = -1;
    uint8_t one = 1;
    hs_run *h;
    CHECK(hs_start_ends(cb, CALRT_ENGINE_PING, &s, &t, &p, &one, 1, 2, NULL, off, ids, NULL, &h) ==
          CALRT_E_INVALID_ARGUMENT);
    off[0] = 0;
    off[1] = -1;
    CHECK(hs_start_ends(cb, CALRT_ENGINE_PING, &s, &t, &p, &one, 1, 2, NULL, off, ids, NULL, &h) ==
          CALRT_E_INVALID_ARGUMENT);
    off[1] = 1;
    CHECK(hs_start_ends(cb, CALRT_ENGINE_PING, &s, &t, &p, &one, 1, 2, NULL, off, ids, &from, &h) ==
          CALRT_E_INVALID_ARGUMENT);
    CHECK(hs_start_ends(cb, CALRT_ENGINE_PING, &s, &t, &p, &one, 1, 2, NULL, off, NULL, NULL, &h) ==
          CALRT_E_INVALID_ARGUMENT);
  }
  /* case 0: lane 0 ends on its step-2 token, lane 1 on its step-5 token counted from step 5 only,
   * lane 3 has none (runs all S): the run runs S steps. Case 1: every lane ends early (lane 3 on its
   * step-3 token, lane 1 on its own lane_steps of 2): the run ends with its last lane. */
  for (int c = 0; c < 2; c++) {
    int32_t sh[4] = {-1, -1, -1, -1}, sr[4] = {-1, -1, -1, -1}, sq[4] = {-1, -1, -1, -1};
    int32_t tok_h[4] = {0}, tok_r[4] = {0}, tok_q[4] = {0}, pos[4] = {0};
    uint8_t valid[4] = {0};
    for (int i = 0; i < 3; i++) {
      const int L = lane_of[i];
      sh[L] = test_prefilled(cb, prompts[i], 4, &tok_h[L]);
      sr[L] = test_prefilled(cb, prompts[i], 4, &tok_r[L]);
      sq[L] = test_prefilled(cb, prompts[i], 4, &tok_q[L]);
      pos[L] = 4;
      valid[L] = 1;
    }
    int32_t full[4] = {S, S, 0, S}, want[4][64], want2[4][64];
    float last[4][V];
    reference(cb, 4, sr, tok_r, pos, valid, full, S, want, last); /* every lane's S greedy tokens */
    int32_t ls[4] = {S, c ? 2 : S, 0, S};
    int32_t off[5], ids[8], from[4] = {0, c ? 0 : 5, 0, 0}, n = 0;
    off[0] = 0;
    ids[n++] = want[0][2];
    ids[n++] = -7; /* never drawn */
    off[1] = n;
    if (!c) ids[n++] = want[1][5];
    off[2] = n;
    ids[n++] = want[1][1]; /* lane 2 is invalid: its ends are never looked at */
    off[3] = n;
    if (c) ids[n++] = want[3][3];
    off[4] = n;
    /* each lane's expected steps: its first end token at or after its end_from, else its lane_steps */
    int32_t steps_of[4] = {0, 0, 0, 0}, most = 0;
    for (int l = 0; l < 4; l++) {
      if (!valid[l]) continue;
      steps_of[l] = ls[l];
      for (int k = from[l]; k < ls[l]; k++) {
        int hit = 0;
        for (int i = off[l]; i < off[l + 1]; i++) hit |= ids[i] == want[l][k];
        if (hit) {
          steps_of[l] = k + 1;
          break;
        }
      }
      if (steps_of[l] > most) most = steps_of[l];
    }
    CHECK(steps_of[0] <= 3 && (c || steps_of[1] == 6 || want[1][5] == want[1][4]) && (c || steps_of[3] == S));
    CHECK(c ? most < S : most == S);
    hs_run *h;
    calrt_job_status st;
    CHECK(hs_start_ends(cb, CALRT_ENGINE_PONG, sh, tok_h, pos, valid, 4, S, ls, off, ids, from, &h) == CALRT_OK);
    CHECK(hs_lane_steps(h) == NULL || hs_poll(h));
    CHECK(hs_wait(h, -1, &st) == CALRT_OK && st == CALRT_JOB_OK);
    CHECK(hs_steps(h) == S && hs_steps_run(h) == most && hs_submitted(h) == most && hs_short(h));
    const int32_t *per = hs_lane_steps(h);
    CHECK(per != NULL);
    reference(cb, 4, sq, tok_q, pos, valid, steps_of, most, want2, last);
    calrt_job_result r;
    const int32_t *st_tok;
    CHECK(hs_result(h, &r, &st_tok) == CALRT_OK);
    for (int l = 0; l < 4; l++) CHECK(per[l] == steps_of[l]); /* 0 for the invalid lane */
    check_lanes(cb, &r, st_tok, 4, most, sh, pos, valid, steps_of, want, last);
    hs_free(h);
    for (int l = 0; l < 4; l++)
      if (valid[l]) {
        CHECK(calrt_kv_free_sequence(cb, sh[l]) == CALRT_OK);
        CHECK(calrt_kv_free_sequence(cb, sr[l]) == CALRT_OK);
        CHECK(calrt_kv_free_sequence(cb, sq[l]) == CALRT_OK);
      }
  }
  /* no end token drawn: nothing short, the lane steps as asked */
  {
    const int32_t prompt[4] = {3, 9, 27, 20};
    int32_t s[4] = {-1, -1, -1, -1}, tok[4] = {0}, pos[4] = {4, 0, 0, 0}, off[5] = {0, 1, 1, 1, 1}, ids[1] = {-1};
    uint8_t valid[4] = {1, 0, 0, 0};
    s[0] = test_prefilled(cb, prompt, 4, &tok[0]);
    hs_run *h;
    calrt_job_status st;
    CHECK(hs_start_ends(cb, CALRT_ENGINE_PING, s, tok, pos, valid, 4, 3, NULL, off, ids, NULL, &h) == CALRT_OK);
    CHECK(hs_wait(h, -1, &st) == CALRT_OK && st == CALRT_JOB_OK && !hs_short(h) && hs_steps_run(h) == 3);
    CHECK(hs_lane_steps(h)[0] == 3 && hs_lane_steps(h)[1] == 0);
    hs_free(h);
    CHECK(calrt_kv_free_sequence(cb, s[0]) == CALRT_OK);
  }
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

int main(void) {
  test_model tm;
  make_model(&tm, 0);
  calrt_open_params op = {.profile = "sim-next", .dram_bytes = 64u << 20};
  calrt_device *dev;
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  equivalence(dev, &tm, 4, 2, 0, 1);
  equivalence(dev, &tm, 4, 7, 0, 1);
  equivalence(dev, &tm, 4, 5, 1, 1);
  equivalence(dev, &tm, 1, 4, 0, 1);
  faults(dev, &tm);
  polling(dev, &tm);
  stopping(dev, &tm);
  ending(dev, &tm);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  /* calrt-0.7.6: no multi-step of its own, the host's runs all the same */
  calrt_open_params old = {.profile = "calrt-0.7.6", .dram_bytes = 64u << 20};
  CHECK(calrt_device_open(&old, &dev) == CALRT_OK);
  calrt_device_info di;
  CHECK(calrt_device_info_get(dev, &di) == CALRT_OK && di.multi_step == 0);
  equivalence(dev, &tm, 1, 6, 0, 0);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  free_model(&tm);
  fprintf(stderr, "test_host_steps: OK\n");
  return 0;
}
