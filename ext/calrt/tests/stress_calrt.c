/* Multi-threaded stress of calrt-sim (run under TSAN by `make tsan-test`): worker threads submit
 * prefill/decode jobs to both engines of both chips and wait with random timeouts, while a chaos thread
 * injects random faults and resets chips. Chip 1 holds a shared-KV group (B4 + B1 member): its workers
 * move their sequence between the two profiles at random; every other prompt is a prefill-all (prompt
 * logits, one output lane per token, C3-style) instead of a prefill. A churn thread keeps creating a B2 member of
 * chip 0's KV group, running a sequence on it and destroying it while chip 0's workers use the owner.
 * Checks: every submitted job completes exactly once (waits return a status; aborted/failed jobs leave
 * no KV commit), nothing deadlocks, no data race, DRAM back to zero. A poller thread drains the
 * completion eventfds of all four engines (calrt_sim_engine_completion_fd) while all this runs: the
 * counts it reads add up to each engine's completions. */
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include <unistd.h>

#include "common.h"

#define THREADS 8
#define ITERS 500

static calrt_device *dev;
static calrt_calbin *cbs[3]; /* chip 0: B1; chip 1: B4 + B1 sharing its KV group */
static atomic_int stop_chaos;
static atomic_long completed_ok, completed_other, churn_rounds;
static int cfds[4];        /* completion fds: chip * 2 + engine */
static uint64_t cfd_count[4]; /* poller's totals (read by main after join) */

static void drain_fds(void) {
  for (int k = 0; k < 4; k++) {
    uint64_t v;
    if (read(cfds[k], &v, sizeof v) == (ssize_t)sizeof v) cfd_count[k] += v;
  }
}

static void *poller(void *arg) {
  struct pollfd p[4];
  for (int k = 0; k < 4; k++) p[k] = (struct pollfd){cfds[k], POLLIN, 0};
  while (!atomic_load(&stop_chaos)) {
    if (poll(p, 4, 5) > 0) drain_fds();
  }
  return NULL;
}

static unsigned rnd(unsigned *s) { *s = *s * 1103515245u + 12345u; return (*s >> 16) & 0x7FFF; }

static void *worker(void *arg) {
  unsigned seed = (unsigned)(uintptr_t)arg * 7919u + 1;
  int chip = (int)(uintptr_t)arg % 2;
  calrt_calbin *cb = cbs[chip];
  int lanes = chip ? 4 : 1;
  int32_t seq = -1, len = 0, tok = 1;
  for (int it = 0; it < ITERS; it++) {
    if (chip == 1) { /* same sequence, either profile of the group */
      int b1 = rnd(&seed) % 2;
      cb = cbs[b1 ? 2 : 1];
      lanes = b1 ? 1 : 4;
    }
    int valid = 0;
    if (seq >= 0 && (calrt_kv_sequence_valid(cb, seq, &valid) != CALRT_OK || !valid)) {
      CHECK(calrt_kv_free_sequence(cb, seq) == CALRT_OK);
      seq = -1;
    }
    if (seq < 0 || len > 40) {
      if (seq >= 0) CHECK(calrt_kv_free_sequence(cb, seq) == CALRT_OK);
      seq = -1;
      calrt_status st = calrt_kv_create_sequence(cb, &seq);
      if (st != CALRT_OK) { /* needs reconfigure or out of sequences: retry later */
        seq = -1;
        if (st == CALRT_E_NEEDS_RECONFIGURE) calrt_calbin_configure(cb);
        usleep(200);
        continue;
      }
      len = 0;
    }
    calrt_job *j = NULL;
    int all = 0; /* a prefill-all: 3 output lanes, all of the one sequence */
    if (len == 0) {
      int32_t p[3] = {1, 2, (int32_t)(rnd(&seed) % 61)};
      all = (int)(rnd(&seed) % 2);
      CHECK((all ? calrt_job_create_prefill_all(cb, seq, p, 3, &j) : calrt_job_create_prefill(cb, seq, p, 3, &j)) ==
            CALRT_OK);
    } else {
      int32_t sid[4] = {seq, 0, 0, 0}, tk[4] = {tok, 0, 0, 0}, ps[4] = {len, 0, 0, 0};
      uint8_t va[4] = {1, 0, 0, 0};
      CHECK(calrt_job_create_decode(cb, sid, tk, ps, va, lanes, &j) == CALRT_OK);
    }
    calrt_engine e = rnd(&seed) % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING;
    calrt_status st = calrt_job_submit(j, e);
    if (st != CALRT_OK) {
      CHECK(st == CALRT_E_BUSY || st == CALRT_E_FAULTED || st == CALRT_E_NEEDS_RECONFIGURE);
      if (st == CALRT_E_NEEDS_RECONFIGURE) calrt_calbin_configure(cb);
      calrt_job_release(j);
      usleep(100);
      continue;
    }
    calrt_job_status js;
    while ((st = calrt_job_wait(j, (int64_t)(rnd(&seed) % 3000), &js)) == CALRT_E_TIMEOUT) {
    }
    CHECK(st == CALRT_OK);
    calrt_job_result r;
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
    CHECK(r.echo[0] == calrt_job_id(j) && r.echo[1] == seq);
    CHECK(r.lanes == (all ? 3 : len == 0 ? 1 : lanes));
    for (int l = 1; all && l < 3; l++)
      CHECK(r.echo[3 * l] == calrt_job_id(j) && r.echo[3 * l + 1] == seq &&
            (js != CALRT_JOB_OK || r.echo[3 * l + 2] == l));
    if (js == CALRT_JOB_OK) {
      atomic_fetch_add(&completed_ok, 1);
      len += len == 0 ? 3 : 1; /* committed once, a prefill-all's 3 lanes notwithstanding */
      tok = (int32_t)(r.checksum[all ? 2 : 0] % 61);
      int32_t cl = -1;
      if (calrt_kv_committed_len(cb, seq, &cl) == CALRT_OK) CHECK(cl == len);
    } else {
      atomic_fetch_add(&completed_other, 1);
      int32_t cl = -1; /* nothing committed: resync from the device (or the sequence is gone) */
      if (calrt_kv_committed_len(cb, seq, &cl) == CALRT_OK) len = cl;
      if (len > 0 && rnd(&seed) % 2 && calrt_kv_remove_tokens_at_end(cb, seq, 1) == CALRT_OK) len--;
    }
    calrt_job_release(j);
  }
  if (seq >= 0) CHECK(calrt_kv_free_sequence(cb, seq) == CALRT_OK);
  return NULL;
}

/* Members joining and leaving chip 0's KV group while its owner is in use. */
static void *churn(void *arg) {
  test_model *tm = arg;
  calrt_profile p2 = {2, 48, THREADS, CALRT_KV_FP32, 1, 0};
  calrt_timing t = {20, 5, 100, 0.5};
  unsigned seed = 99;
  while (!atomic_load(&stop_chaos)) {
    calrt_calbin *m = NULL;
    CHECK(calrt_calbin_create(dev, 0, &tm->m, tm->t, (size_t)tm->n, &p2, &t, &m) == CALRT_OK);
    calrt_status st = calrt_calbin_share_kv(m, cbs[0]);
    CHECK(st == CALRT_OK || st == CALRT_E_NEEDS_RECONFIGURE);
    if (st == CALRT_OK) st = calrt_calbin_configure(m);
    int32_t seq = -1;
    if (st == CALRT_OK) st = calrt_kv_create_sequence(m, &seq);
    CHECK(st == CALRT_OK || st == CALRT_E_FAULTED || st == CALRT_E_NEEDS_RECONFIGURE ||
          st == CALRT_E_OUT_OF_SEQUENCES);
    for (int k = 0; st == CALRT_OK && k < 4; k++) {
      calrt_job *j = NULL;
      int32_t p[2] = {3, (int32_t)(rnd(&seed) % 61)}, len = 0;
      if (calrt_kv_committed_len(m, seq, &len) != CALRT_OK) break;
      if (len == 0) {
        CHECK(calrt_job_create_prefill(m, seq, p, 2, &j) == CALRT_OK);
      } else {
        int32_t sid[2] = {seq, seq}, tk[2] = {p[1], 0}, ps[2] = {len, 0};
        uint8_t va[2] = {1, 0};
        CHECK(calrt_job_create_decode(m, sid, tk, ps, va, 2, &j) == CALRT_OK);
      }
      if (calrt_job_submit(j, rnd(&seed) % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_OK) {
        calrt_job_status js;
        CHECK(calrt_job_wait(j, -1, &js) == CALRT_OK);
      }
      calrt_job_release(j);
    }
    if (seq >= 0) CHECK(calrt_kv_free_sequence(m, seq) == CALRT_OK);
    CHECK(calrt_calbin_destroy(m) == CALRT_OK); /* nothing in flight on it: always allowed */
    atomic_fetch_add(&churn_rounds, 1);
  }
  return NULL;
}

static void *chaos(void *arg) {
  unsigned seed = 4242;
  while (!atomic_load(&stop_chaos)) {
    usleep(2000 + rnd(&seed) % 4000);
    int chip = (int)(rnd(&seed) % 2);
    int what = (int)(rnd(&seed) % 7);
    if (what < 5)
      calrt_sim_inject_fault(dev, chip, (calrt_engine)(rnd(&seed) % 2), (calrt_sim_fault)what,
                             (int32_t)(1 + rnd(&seed) % 4), 0);
    else
      CHECK(calrt_device_reset(dev, what == 5 ? chip : -1) == CALRT_OK);
    calrt_counters c;
    CHECK(calrt_engine_counters(dev, chip, CALRT_ENGINE_PING, &c) == CALRT_OK);
    CHECK(c.inflight <= CALRT_QUEUE_DEPTH);
  }
  return NULL;
}

int main(void) {
  /* Kernels on 3 worker threads per engine (the pool of pool.c), on a Llama big enough to use them. */
  setenv("CALRT_SIM_THREADS", "3", 1);
  calrt_open_params op = {.profile = "sim-next", .dram_bytes = 256u << 20};
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  CHECK(calrt_sim_configure(dev, 0, 300, 7) == CALRT_OK); /* completion jitter shuffles order */
  test_model tm;
  make_llama(&tm, 1, CALRT_ARCH_LLAMA);
  calrt_profile p1 = {1, 48, THREADS, CALRT_KV_FP32, 1, 0}, p4 = {4, 48, THREADS, CALRT_KV_BF16, 1, 0};
  calrt_profile p1b = {1, 48, THREADS, CALRT_KV_BF16, 1, 0};
  calrt_timing t = {50, 10, 200, 0.5};
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p1, &t, &cbs[0]) == CALRT_OK);
  CHECK(calrt_calbin_configure(cbs[0]) == CALRT_OK);
  CHECK(calrt_calbin_create(dev, 1, &tm.m, tm.t, (size_t)tm.n, &p4, &t, &cbs[1]) == CALRT_OK);
  CHECK(calrt_calbin_configure(cbs[1]) == CALRT_OK);
  CHECK(calrt_calbin_create(dev, 1, &tm.m, tm.t, (size_t)tm.n, &p1b, &t, &cbs[2]) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(cbs[2], cbs[1]) == CALRT_OK);
  CHECK(calrt_calbin_configure(cbs[2]) == CALRT_OK);
  for (int k = 0; k < 4; k++)
    CHECK(calrt_sim_engine_completion_fd(dev, k / 2, (calrt_engine)(k % 2), &cfds[k]) == CALRT_OK);
  pthread_t th[THREADS], ch, cu, po;
  CHECK(pthread_create(&po, NULL, poller, NULL) == 0);
  CHECK(pthread_create(&ch, NULL, chaos, NULL) == 0);
  CHECK(pthread_create(&cu, NULL, churn, &tm) == 0);
  for (uintptr_t i = 0; i < THREADS; i++) CHECK(pthread_create(&th[i], NULL, worker, (void *)i) == 0);
  for (int i = 0; i < THREADS; i++) pthread_join(th[i], NULL);
  atomic_store(&stop_chaos, 1);
  pthread_join(ch, NULL);
  /* The churn thread waits without a timeout: a job of its last round may hang on a TIMEOUT fault
   * the chaos thread armed before it stopped, and nothing else would reset the chip any more. A reset
   * aborts that job and disarms every fault (it used to hang ~1 run in 20 under TSAN). */
  CHECK(calrt_device_reset(dev, -1) == CALRT_OK);
  pthread_join(cu, NULL);
  pthread_join(po, NULL);
  CHECK(calrt_device_reset(dev, -1) == CALRT_OK);
  drain_fds(); /* the reset returned after every job completed, so every count was written */
  for (int c = 0; c < 2; c++) {
    calrt_counters a, b;
    CHECK(calrt_engine_counters(dev, c, CALRT_ENGINE_PING, &a) == CALRT_OK);
    CHECK(calrt_engine_counters(dev, c, CALRT_ENGINE_PONG, &b) == CALRT_OK);
    CHECK(a.inflight == 0 && b.inflight == 0);
    CHECK(a.submitted == a.completed + a.failed && b.submitted == b.completed + b.failed);
    CHECK(cfd_count[2 * c] == a.completed + a.failed && cfd_count[2 * c + 1] == b.completed + b.failed);
  }
  CHECK(calrt_calbin_destroy(cbs[0]) == CALRT_OK);
  CHECK(calrt_calbin_destroy(cbs[1]) == CALRT_OK); /* the group's creator first: cbs[2] keeps the KV */
  uint64_t cap, used;
  calrt_calbin_info i2;
  CHECK(calrt_calbin_info_get(cbs[2], &i2) == CALRT_OK && i2.kv_group_size == 1);
  CHECK(calrt_device_dram(dev, 1, &cap, &used) == CALRT_OK && used == i2.dram_bytes + i2.shared_dram_bytes);
  CHECK(calrt_calbin_destroy(cbs[2]) == CALRT_OK);
  CHECK(calrt_device_dram(dev, 0, &cap, &used) == CALRT_OK && used == 0);
  CHECK(calrt_device_dram(dev, 1, &cap, &used) == CALRT_OK && used == 0);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  free_model(&tm);
  printf("calrt-sim stress: OK (%ld ok, %ld failed/aborted/invalid, %ld member join/leave rounds, "
         "%llu completion fd counts)\n", atomic_load(&completed_ok), atomic_load(&completed_other),
         atomic_load(&churn_rounds),
         (unsigned long long)(cfd_count[0] + cfd_count[1] + cfd_count[2] + cfd_count[3]));
  return 0;
}
