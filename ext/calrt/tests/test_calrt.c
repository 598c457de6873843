/* Plain-C tests of calrt-sim (run under ASAN+UBSAN by `make asan-test`). */
#include <math.h>

#include "common.h"

static calrt_job_status run(calrt_job *j, calrt_engine e) {
  calrt_job_status st = CALRT_JOB_INVALID;
  CHECK(calrt_job_submit(j, e) == CALRT_OK);
  CHECK(calrt_job_wait(j, 10 * 1000 * 1000, &st) == CALRT_OK);
  return st;
}

static int argmax(const float *x, int n) {
  int b = 0;
  for (int i = 1; i < n; i++) if (x[i] > x[b]) b = i;
  return b;
}

int main(void) {
  calrt_device *dev = NULL, *dev2 = NULL;
  calrt_open_params op = {"sim-next", 64u << 20};
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  CHECK(calrt_device_open(&op, &dev2) == CALRT_E_ALREADY_OPEN);
  test_model tm;
  make_model(&tm, 0);
  calrt_profile p1 = {1, 48, 3, CALRT_KV_BF16, 1, 0}, p4 = {4, 48, 5, CALRT_KV_BF16, 1, 0};
  calrt_timing t0 = {0};
  calrt_calbin *c1 = NULL, *c4 = NULL;
  uint64_t cap, used0, used;
  CHECK(calrt_device_dram(dev, 0, &cap, &used0) == CALRT_OK && used0 == 0);
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p1, &t0, &c1) == CALRT_OK);
  CHECK(calrt_calbin_configure(c1) == CALRT_OK);
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p4, &t0, &c4) == CALRT_OK);
  CHECK(calrt_calbin_configure(c4) == CALRT_OK);
  CHECK(calrt_device_dram(dev, 0, &cap, &used) == CALRT_OK && used > 0);

  /* B1 reference run of two sequences, then the same at B4 lanes 1 and 3: bitwise equal. */
  const int V = tm.m.vocab_size, STEPS = 5;
  float ref[2][5][61];
  int32_t prompts[2][4] = {{1, 2, 3, 4}, {9, 8, 7, 0}};
  int plen[2] = {4, 3};
  for (int s = 0; s < 2; s++) {
    int32_t seq;
    CHECK(calrt_kv_create_sequence(c1, &seq) == CALRT_OK);
    calrt_job *j;
    CHECK(calrt_job_create_prefill(c1, seq, prompts[s], plen[s], &j) == CALRT_OK);
    CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
    calrt_job_result r;
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
    int32_t tok = argmax(r.logits, V);
    CHECK(r.checksum[0] == calrt_checksum(r.logits, sizeof(float) * (size_t)V));
    calrt_job_release(j);
    for (int k = 0; k < STEPS; k++) {
      int32_t pos = plen[s] + k;
      uint8_t valid = 1;
      CHECK(calrt_job_create_decode(c1, &seq, &tok, &pos, &valid, 1, &j) == CALRT_OK);
      CHECK(run(j, k % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_JOB_OK);
      CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
      memcpy(ref[s][k], r.logits, sizeof(float) * (size_t)V);
      for (int v = 0; v < V; v++) CHECK(isfinite(r.logits[v]));
      tok = argmax(r.logits, V);
      calrt_job_release(j);
    }
    CHECK(calrt_kv_free_sequence(c1, seq) == CALRT_OK);
  }
  int32_t seqs[2], toks[2], idle;
  CHECK(calrt_kv_create_sequence(c4, &idle) == CALRT_OK);
  for (int s = 0; s < 2; s++) {
    calrt_job *j;
    calrt_job_result r;
    CHECK(calrt_kv_create_sequence(c4, &seqs[s]) == CALRT_OK);
    CHECK(calrt_job_create_prefill(c4, seqs[s], prompts[s], plen[s], &j) == CALRT_OK);
    CHECK(run(j, CALRT_ENGINE_PONG) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
    toks[s] = argmax(r.logits, V);
    calrt_job_release(j);
  }
  size_t kvn = 0;
  CHECK(calrt_sim_read_kv(c4, idle, NULL, &kvn) == CALRT_OK && kvn > 0);
  unsigned char *kv0 = calloc(1, kvn), *kv1 = calloc(1, kvn);
  CHECK(calrt_sim_read_kv(c4, idle, kv0, &kvn) == CALRT_OK);
  for (int k = 0; k < STEPS; k++) {
    int32_t sid[4] = {idle, seqs[0], idle, seqs[1]}, tk[4] = {5, toks[0], 6, toks[1]};
    int32_t ps[4] = {0, plen[0] + k, 0, plen[1] + k};
    uint8_t va[4] = {0, 1, 0, 1};
    calrt_job *j;
    calrt_job_result r;
    CHECK(calrt_job_create_decode(c4, sid, tk, ps, va, 4, &j) == CALRT_OK);
    CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
    CHECK(memcmp(r.logits + V, ref[0][k], sizeof(float) * (size_t)V) == 0);
    CHECK(memcmp(r.logits + 3 * V, ref[1][k], sizeof(float) * (size_t)V) == 0);
    CHECK(r.echo[3 * 0 + 1] == -1 && r.echo[3 * 1 + 1] == seqs[0] && r.echo[3 * 3 + 2] == plen[1] + k);
    toks[0] = argmax(r.logits + V, V);
    toks[1] = argmax(r.logits + 3 * V, V);
    calrt_job_release(j);
  }
  CHECK(calrt_sim_read_kv(c4, idle, kv1, &kvn) == CALRT_OK);
  CHECK(memcmp(kv0, kv1, kvn) == 0);
  free(kv0);
  free(kv1);

  /* Faults: TIMEOUT + reset -> ABORTED; CCU -> unknown KV; DMA -> reconfigure; BUSY. */
  calrt_job *j, *j2;
  int32_t tk = 1, ps = plen[0] + STEPS;
  uint8_t one = 1;
  calrt_job_status st;
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_TIMEOUT, 1, 0) == CALRT_OK);
  int32_t s1;
  CHECK(calrt_kv_create_sequence(c1, &s1) == CALRT_OK);
  CHECK(calrt_job_create_prefill(c1, s1, &tk, 1, &j) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PING) == CALRT_OK);
  CHECK(calrt_job_wait(j, 20000, &st) == CALRT_E_TIMEOUT);
  CHECK(calrt_calbin_destroy(c1) == CALRT_E_IN_USE);
  calrt_counters cn;
  CHECK(calrt_engine_counters(dev, 0, CALRT_ENGINE_PING, &cn) == CALRT_OK && cn.timeouts == 1 && cn.inflight == 1);
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
  CHECK(calrt_job_wait(j, -1, &st) == CALRT_OK && st == CALRT_JOB_ABORTED);
  calrt_job_release(j);
  int valid = 1;
  CHECK(calrt_kv_sequence_valid(c1, s1, &valid) == CALRT_OK && !valid);
  CHECK(calrt_kv_free_sequence(c1, s1) == CALRT_OK);
  CHECK(calrt_kv_create_sequence(c1, &s1) == CALRT_OK);

  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PONG, CALRT_SIM_FAULT_CCU, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_prefill(c1, s1, &tk, 1, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PONG) == CALRT_JOB_CCU_FAULT);
  calrt_job_release(j);
  CHECK(calrt_kv_sequence_valid(c1, s1, &valid) == CALRT_OK && !valid);
  CHECK(calrt_job_create_prefill(c1, s1, &tk, 1, &j) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PING) == CALRT_E_FAULTED);
  calrt_job_release(j);
  CHECK(calrt_device_reset(dev, -1) == CALRT_OK);
  CHECK(calrt_kv_free_sequence(c1, s1) == CALRT_OK);
  CHECK(calrt_kv_create_sequence(c1, &s1) == CALRT_OK);

  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_DMA_UNKNOWN, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_prefill(c1, s1, &tk, 1, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_DMA_UNKNOWN);
  calrt_job_release(j);
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
  int f, nr;
  CHECK(calrt_device_state(dev, 0, &f, &nr) == CALRT_OK && !f && nr);
  CHECK(calrt_kv_free_sequence(c1, s1) == CALRT_OK);
  CHECK(calrt_kv_create_sequence(c1, &s1) == CALRT_E_NEEDS_RECONFIGURE);
  CHECK(calrt_calbin_configure(c1) == CALRT_OK);
  CHECK(calrt_calbin_configure(c4) == CALRT_OK);
  CHECK(calrt_kv_create_sequence(c1, &s1) == CALRT_OK);

  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_BUSY, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_decode(c1, &s1, &tk, &ps, &one, 1, &j) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PING) == CALRT_E_BUSY);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PING) == CALRT_OK); /* position mismatch -> INVALID */
  CHECK(calrt_job_wait(j, -1, &st) == CALRT_OK && st == CALRT_JOB_INVALID);
  calrt_job_release(j);
  /* A job dropped by the caller while in flight frees itself on completion. */
  CHECK(calrt_job_create_prefill(c1, s1, &tk, 1, &j2) == CALRT_OK);
  CHECK(calrt_job_submit(j2, CALRT_ENGINE_PONG) == CALRT_OK);
  calrt_job_release(j2);
  CHECK(calrt_device_reset(dev, -1) == CALRT_OK);

  /* NotSupported ops and capability refusals on calrt-0.7.6 after close/reopen. */
  CHECK(calrt_kv_copy_prefix(c1, 0, 1, 1) == CALRT_E_NOT_SUPPORTED);
  CHECK(calrt_kv_keep_one(c1, 0) == CALRT_E_NOT_SUPPORTED);
  CHECK(calrt_device_close(dev) == CALRT_E_IN_USE);
  CHECK(calrt_calbin_destroy(c1) == CALRT_OK);
  CHECK(calrt_calbin_destroy(c4) == CALRT_OK);
  CHECK(calrt_device_dram(dev, 0, &cap, &used) == CALRT_OK && used == used0);
  CHECK(calrt_device_close(dev) == CALRT_OK);

  calrt_open_params old = {"calrt-0.7.6", 64u << 20};
  CHECK(calrt_device_open(&old, &dev) == CALRT_OK);
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p4, &t0, &c4) == CALRT_E_NOT_SUPPORTED);
  CHECK(calrt_calbin_create(dev, 1, &tm.m, tm.t, (size_t)tm.n, &p1, &t0, &c1) == CALRT_E_NOT_SUPPORTED);
  calrt_calbin *a, *b;
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p1, &t0, &a) == CALRT_OK);
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p1, &t0, &b) == CALRT_OK);
  CHECK(calrt_calbin_configure(a) == CALRT_OK);
  CHECK(calrt_calbin_configure(b) == CALRT_E_NOT_SUPPORTED);
  CHECK(calrt_calbin_reset_configuration(a) == CALRT_OK);
  CHECK(calrt_calbin_configure(b) == CALRT_OK);
  calrt_profile huge = {1, 1 << 20, 64, CALRT_KV_FP32, 1, 0};
  calrt_calbin *h;
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &huge, &t0, &h) == CALRT_OK);
  CHECK(calrt_calbin_destroy(b) == CALRT_OK);
  CHECK(calrt_calbin_configure(h) == CALRT_E_OUT_OF_DEVICE_MEMORY);
  CHECK(calrt_calbin_destroy(h) == CALRT_OK);
  CHECK(calrt_calbin_destroy(a) == CALRT_OK);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  free_model(&tm);
  printf("calrt-sim C tests: OK\n");
  return 0;
}
