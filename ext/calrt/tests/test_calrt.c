/* Plain-C tests of calrt-sim (run under ASAN+UBSAN by `make asan-test`). */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <poll.h>
#include <unistd.h>

#include "common.h"

/* Greedy decode `steps` tokens of `seq` at `lane` of the calbin chosen per step (cbs[pick[k]]), after
 * a prefill on cbs[0]; logits rows into out[steps + 1][V]. */
static void run_schedule(calrt_calbin **cbs, const int *lanes_of, const int *pick, int steps, int32_t seq,
                         const int32_t *prompt, int plen, int V, float *out) {
  calrt_job *j;
  calrt_job_result r;
  CHECK(calrt_job_create_prefill(cbs[0], seq, prompt, plen, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
  memcpy(out, r.logits, sizeof(float) * (size_t)V);
  calrt_job_release(j);
  for (int k = 0; k < steps; k++) {
    calrt_calbin *cb = cbs[pick[k]];
    int B = lanes_of[pick[k]], lane = k % B;
    int32_t sid[16], tk[16], ps[16];
    uint8_t va[16] = {0};
    for (int l = 0; l < B; l++) { sid[l] = seq; tk[l] = 0; ps[l] = 0; }
    tk[lane] = argmax(out + (size_t)k * V, V);
    ps[lane] = plen + k;
    va[lane] = 1;
    CHECK(calrt_job_create_decode(cb, sid, tk, ps, va, B, &j) == CALRT_OK);
    CHECK(run(j, k % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
    CHECK(r.echo[3 * lane + 1] == seq && r.echo[3 * lane + 2] == plen + k);
    memcpy(out + (size_t)(k + 1) * V, r.logits + (size_t)lane * V, sizeof(float) * (size_t)V);
    calrt_job_release(j);
  }
}


/* Shared KV groups (C3, sim-next): refusals, DRAM charged once, bitwise B1/B4 interleaving, release
 * in either order, reset invalidation, in-use rules across members. */
static void test_shared_kv(calrt_device *dev, test_model *tm) {
  const int V = tm->m.vocab_size, STEPS = 6;
  calrt_profile p1 = {1, 40, 3, CALRT_KV_FP32, 1, 0}, p4 = {4, 40, 3, CALRT_KV_FP32, 1, 0};
  calrt_timing t0 = {0};
  uint64_t cap, base, used;
  CHECK(calrt_device_dram(dev, 0, &cap, &base) == CALRT_OK);
  calrt_calbin *o, *m, *bad;
  CHECK(calrt_calbin_create(dev, 0, &tm->m, tm->t, (size_t)tm->n, &p1, &t0, &o) == CALRT_OK);
  CHECK(calrt_calbin_create(dev, 0, &tm->m, tm->t, (size_t)tm->n, &p4, &t0, &m) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(m, o) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("not configured"));
  CHECK(calrt_calbin_configure(o) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(o, o) == CALRT_E_INVALID_ARGUMENT);
  CHECK(calrt_calbin_share_kv(o, m) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("already configured"));
  /* mismatches, each named */
  calrt_profile pb = p4;
  pb.max_sequences = 4;
  CHECK(calrt_calbin_create(dev, 0, &tm->m, tm->t, (size_t)tm->n, &pb, &t0, &bad) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(bad, o) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("max_sequences"));
  CHECK(calrt_calbin_destroy(bad) == CALRT_OK);
  pb = p4;
  pb.kv_dtype = CALRT_KV_BF16;
  CHECK(calrt_calbin_create(dev, 0, &tm->m, tm->t, (size_t)tm->n, &pb, &t0, &bad) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(bad, o) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("kv_dtype"));
  CHECK(calrt_calbin_destroy(bad) == CALRT_OK);
  calrt_model_desc md = tm->m;
  md.rope_theta = 5e5;
  CHECK(calrt_calbin_create(dev, 0, &md, tm->t, (size_t)tm->n, &p4, &t0, &bad) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(bad, o) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("rope_theta"));
  CHECK(calrt_calbin_destroy(bad) == CALRT_OK);
  md = tm->m;
  md.sliding_window = 5;
  CHECK(calrt_calbin_create(dev, 0, &md, tm->t, (size_t)tm->n, &p4, &t0, &bad) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(bad, o) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("sliding_window"));
  CHECK(calrt_calbin_destroy(bad) == CALRT_OK);
  calrt_tensor copy[64];
  memcpy(copy, tm->t, sizeof(calrt_tensor) * (size_t)tm->n);
  size_t nb = sizeof(float) * (size_t)(copy[5].shape[0] * (copy[5].ndim == 2 ? copy[5].shape[1] : 1));
  float *dup = malloc(nb);
  memcpy(dup, copy[5].data, nb);
  copy[5].data = dup;
  CHECK(calrt_calbin_create(dev, 0, &tm->m, copy, (size_t)tm->n, &p4, &t0, &bad) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(bad, o) == CALRT_E_INVALID_ARGUMENT && ERR_HAS(tm->names[5]));
  CHECK(calrt_calbin_destroy(bad) == CALRT_OK);
  free(dup);
  CHECK(calrt_calbin_create(dev, 1, &tm->m, tm->t, (size_t)tm->n, &p4, &t0, &bad) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(bad, o) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("chip"));
  CHECK(calrt_calbin_destroy(bad) == CALRT_OK);
  CHECK(calrt_device_dram(dev, 0, &cap, &used) == CALRT_OK);
  calrt_calbin_info io, im;
  CHECK(calrt_calbin_info_get(o, &io) == CALRT_OK && used - base == io.dram_bytes);
  CHECK(io.kv_group_id > 0 && io.kv_group_size == 1 && io.shared_dram_bytes < io.dram_bytes);

  /* join: only the member's own pools are charged */
  CHECK(calrt_calbin_share_kv(m, o) == CALRT_OK);
  CHECK(calrt_calbin_configure(m) == CALRT_OK);
  CHECK(calrt_calbin_info_get(m, &im) == CALRT_OK && calrt_calbin_info_get(o, &io) == CALRT_OK);
  CHECK(im.kv_group_id == io.kv_group_id && im.kv_group_size == 2 && io.kv_group_size == 2);
  CHECK(im.dram_bytes < im.shared_dram_bytes && im.shared_dram_bytes == io.shared_dram_bytes);
  uint64_t used2;
  CHECK(calrt_device_dram(dev, 0, &cap, &used2) == CALRT_OK && used2 - used == im.dram_bytes);

  /* bitwise: B1 only vs B1,B1,B4,B4,B1,B4 (lanes 0..3 of B4) */
  calrt_calbin *cbs[2] = {o, m};
  int lanes_of[2] = {1, 4}, all1[6] = {0, 0, 0, 0, 0, 0}, mixed[6] = {0, 0, 1, 1, 0, 1};
  int32_t prompt[3] = {4, 50, 7}, sa, sb;
  float *ra = malloc(sizeof(float) * (size_t)V * (STEPS + 1)), *rb = malloc(sizeof(float) * (size_t)V * (STEPS + 1));
  CHECK(calrt_kv_create_sequence(o, &sa) == CALRT_OK && calrt_kv_create_sequence(m, &sb) == CALRT_OK);
  CHECK(sa != sb);
  run_schedule(cbs, lanes_of, all1, STEPS, sa, prompt, 3, V, ra);
  run_schedule(cbs, lanes_of, mixed, STEPS, sb, prompt, 3, V, rb);
  CHECK(memcmp(ra, rb, sizeof(float) * (size_t)V * (STEPS + 1)) == 0);
  free(ra);
  free(rb);
  int32_t len = 0;
  CHECK(calrt_kv_committed_len(o, sb, &len) == CALRT_OK && len == 3 + STEPS);

  /* in use across members: a member's queued job pins the sequence for the owner too */
  calrt_job *j;
  calrt_job_status js;
  int32_t tk = 1;
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PONG, CALRT_SIM_FAULT_TIMEOUT, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_prefill(m, sa, &tk, 1, &j) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PONG) == CALRT_OK);
  CHECK(calrt_kv_free_sequence(o, sa) == CALRT_E_IN_USE);
  CHECK(calrt_kv_remove_tokens_at_end(o, sa, 1) == CALRT_E_IN_USE);
  CHECK(calrt_calbin_destroy(m) == CALRT_E_IN_USE);
  /* the owner has no job in flight: it may leave; the group lives on */
  CHECK(calrt_calbin_destroy(o) == CALRT_OK);
  CHECK(calrt_device_dram(dev, 0, &cap, &used) == CALRT_OK && used - base == im.dram_bytes + im.shared_dram_bytes);
  CHECK(calrt_calbin_info_get(m, &im) == CALRT_OK && im.kv_group_size == 1);
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK); /* aborts the job, invalidates the group once */
  CHECK(calrt_job_wait(j, -1, &js) == CALRT_OK && js == CALRT_JOB_ABORTED);
  calrt_job_release(j);
  int valid = 1;
  CHECK(calrt_kv_sequence_valid(m, sa, &valid) == CALRT_OK && !valid);
  CHECK(calrt_kv_sequence_valid(m, sb, &valid) == CALRT_OK && !valid);
  CHECK(calrt_kv_committed_len(m, sb, &len) == CALRT_E_SEQUENCE_INVALID);
  CHECK(calrt_kv_free_sequence(m, sa) == CALRT_OK && calrt_kv_free_sequence(m, sb) == CALRT_OK);

  /* a new member joins the surviving member; then the member that created nothing leaves last */
  calrt_calbin *o2;
  CHECK(calrt_calbin_create(dev, 0, &tm->m, tm->t, (size_t)tm->n, &p1, &t0, &o2) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(o2, m) == CALRT_OK);
  CHECK(calrt_calbin_destroy(m) == CALRT_OK); /* o2 joined but never configured: still holds the group */
  CHECK(calrt_calbin_configure(o2) == CALRT_OK);
  CHECK(calrt_kv_create_sequence(o2, &sa) == CALRT_OK);
  CHECK(calrt_job_create_prefill(o2, sa, prompt, 3, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  calrt_job_release(j);
  CHECK(calrt_calbin_destroy(o2) == CALRT_OK);
  CHECK(calrt_device_dram(dev, 0, &cap, &used) == CALRT_OK && used == base);
}

static uint64_t drain(int fd) {
  uint64_t v = 0;
  if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0; /* EAGAIN: nothing pending */
  return v;
}
static int readable(int fd, int ms) {
  struct pollfd p = {fd, POLLIN, 0};
  return poll(&p, 1, ms) == 1 && (p.revents & POLLIN);
}

/* calrt_sim_engine_completion_fd on chip 1 (a calbin of its own): one count per completion of any
 * status, after calrt_job_done; per engine; stable fd; closed by calrt_device_close (checked by main). */
static int test_completion_fd(calrt_device *dev, test_model *tm) {
  calrt_profile p1 = {1, 48, 3, CALRT_KV_FP32, 1, 0};
  calrt_timing t0 = {0};
  calrt_calbin *cb;
  CHECK(calrt_calbin_create(dev, 1, &tm->m, tm->t, (size_t)tm->n, &p1, &t0, &cb) == CALRT_OK);
  CHECK(calrt_calbin_configure(cb) == CALRT_OK);
  int fd = -1, fd2 = -1, fdp = -1;
  CHECK(calrt_sim_engine_completion_fd(dev, 1, CALRT_ENGINE_PING, &fd) == CALRT_OK && fd >= 0);
  CHECK(calrt_sim_engine_completion_fd(dev, 1, CALRT_ENGINE_PING, &fd2) == CALRT_OK && fd2 == fd);
  CHECK(calrt_sim_engine_completion_fd(dev, 1, CALRT_ENGINE_PONG, &fdp) == CALRT_OK && fdp >= 0 && fdp != fd);
  CHECK(calrt_sim_engine_completion_fd(dev, 0, CALRT_ENGINE_PING, &fd2) == CALRT_OK && fd2 != fd && fd2 != fdp);
  CHECK(calrt_sim_engine_completion_fd(dev, 2, CALRT_ENGINE_PING, &fd2) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("chip"));
  CHECK(calrt_sim_engine_completion_fd(dev, 1, (calrt_engine)7, &fd2) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("engine"));
  CHECK(calrt_sim_engine_completion_fd(dev, 1, CALRT_ENGINE_PING, NULL) == CALRT_E_INVALID_ARGUMENT);
  CHECK(fcntl(fd, F_GETFL) & O_NONBLOCK);
  CHECK(fcntl(fd, F_GETFD) & FD_CLOEXEC);
  CHECK(drain(fd) == 0 && drain(fdp) == 0 && !readable(fd, 0)); /* created now: no past counts */

  int32_t s, tk = 3;
  CHECK(calrt_kv_create_sequence(cb, &s) == CALRT_OK);
  calrt_job *j, *j2;
  calrt_job_status st;
  /* OK on PING: readable exactly once, and done is already visible when it is. */
  CHECK(calrt_job_create_prefill(cb, s, &tk, 1, &j) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PING) == CALRT_OK);
  CHECK(readable(fd, 10000) && calrt_job_done(j));
  CHECK(drain(fd) == 1 && !readable(fd, 0) && !readable(fdp, 0));
  CHECK(calrt_job_wait(j, 0, &st) == CALRT_OK && st == CALRT_JOB_OK);
  calrt_job_release(j);
  /* INVALID (wrong position) on PONG: counts on PONG's fd only. */
  int32_t bad = 7;
  uint8_t one = 1;
  CHECK(calrt_job_create_decode(cb, &s, &tk, &bad, &one, 1, &j) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PONG) == CALRT_OK);
  CHECK(readable(fdp, 10000) && calrt_job_done(j) && drain(fdp) == 1 && !readable(fd, 0));
  CHECK(calrt_job_wait(j, 0, &st) == CALRT_OK && st == CALRT_JOB_INVALID);
  calrt_job_release(j);
  /* A hung job (TIMEOUT fault) + a queued one: nothing until the reset aborts both -> 2 counts. */
  CHECK(calrt_sim_inject_fault(dev, 1, CALRT_ENGINE_PING, CALRT_SIM_FAULT_TIMEOUT, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_prefill(cb, s, &tk, 1, &j) == CALRT_OK);
  CHECK(calrt_job_create_prefill(cb, s, &tk, 1, &j2) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PING) == CALRT_OK);
  CHECK(calrt_job_submit(j2, CALRT_ENGINE_PING) == CALRT_OK);
  CHECK(!readable(fd, 30) && !calrt_job_done(j));
  CHECK(calrt_device_reset(dev, 1) == CALRT_OK);
  CHECK(readable(fd, 10000));
  CHECK(calrt_job_wait(j, -1, &st) == CALRT_OK && st == CALRT_JOB_ABORTED);
  CHECK(calrt_job_wait(j2, -1, &st) == CALRT_OK && st == CALRT_JOB_ABORTED);
  CHECK(drain(fd) == 2 && !readable(fd, 0));
  calrt_job_release(j);
  calrt_job_release(j2);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
  return fd;
}

/* Board selection: every index in [0, calrt_device_count()) opens, reports itself, others are refused. */
static void test_boards(void) {
  int n = 0;
  CHECK(calrt_device_count(&n) == CALRT_OK && n >= 2);
  calrt_device *dev = NULL;
  calrt_device_info di;
  calrt_open_params bad = {"calrt-0.7.6", 64u << 20, n};
  CHECK(calrt_device_open(&bad, &dev) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("board"));
  bad.device = -1;
  CHECK(calrt_device_open(&bad, &dev) == CALRT_E_INVALID_ARGUMENT);
  calrt_open_params b1 = {"calrt-0.7.6", 64u << 20, 1};
  CHECK(calrt_device_open(&b1, &dev) == CALRT_OK);
  CHECK(calrt_device_info_get(dev, &di) == CALRT_OK && di.device == 1);
  CHECK(strcmp(di.serial, "calrt-sim-board-1") == 0);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  calrt_open_params b0 = {.profile = "calrt-0.7.6", .dram_bytes = 64u << 20};
  CHECK(calrt_device_open(&b0, &dev) == CALRT_OK);
  CHECK(calrt_device_info_get(dev, &di) == CALRT_OK && di.device == 0);
  CHECK(calrt_device_close(dev) == CALRT_OK);
}

/* A sim-next device (256 MiB) whose engines compute with `threads` kernel threads (until unsetenv). */
static calrt_device *open_sim_threads(int threads) {
  char n[16];
  snprintf(n, sizeof n, "%d", threads);
  setenv("CALRT_SIM_THREADS", n, 1);
  calrt_device *dev;
  calrt_open_params op = {.profile = "sim-next", .dram_bytes = 256u << 20};
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  return dev;
}

/* Llama (with Llama 3.1's RoPE frequency divisors) and Qwen2 (its q/k/v biases) through the
 * worker-thread pool: a 40-token prefill and 4 decode steps give bitwise the same logits with 1
 * and 3 kernel threads (CALRT_SIM_THREADS, read when an engine starts computing), and at B1 and in
 * lane 2 of a B4 job. */
static void test_llama_threads(int arch) {
  test_model tm;
  make_llama(&tm, 0, arch);
  if (arch == CALRT_ARCH_LLAMA) { /* a divisors tensor of the wrong length is refused, naming it */
    add(&tm, CALRT_ROPE_FREQS_TENSOR, tm.m.head_dim, 0, 2.0f);
    calrt_device *d0;
    calrt_open_params op0 = {.profile = "sim-next", .dram_bytes = 256u << 20};
    CHECK(calrt_device_open(&op0, &d0) == CALRT_OK);
    calrt_profile p0 = {1, 64, 2, CALRT_KV_FP32, 1, 0};
    calrt_timing t00 = {0};
    calrt_calbin *bad;
    CHECK(calrt_calbin_create(d0, 0, &tm.m, tm.t, (size_t)tm.n, &p0, &t00, &bad) == CALRT_E_INVALID_ARGUMENT);
    CHECK(calrt_device_close(d0) == CALRT_OK);
    tm.t[tm.n - 1].shape[0] = tm.m.head_dim / 2; /* the right length: used from here on */
  }
  const int V = tm.m.vocab_size, STEPS = 4, P = 40;
  float *out[2][2]; /* [threads 1/3][B1/B4] */
  int32_t prompt[40];
  for (int i = 0; i < P; i++) prompt[i] = (i * 37 + 11) % V;
  for (int th = 0; th < 2; th++) {
    calrt_device *dev = open_sim_threads(th ? 3 : 1);
    calrt_profile prof[2] = {{1, 64, 2, CALRT_KV_FP32, 1, 0}, {4, 64, 5, CALRT_KV_FP32, 1, 0}};
    calrt_timing t0 = {0};
    for (int b = 0; b < 2; b++) {
      calrt_calbin *cb;
      CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &prof[b], &t0, &cb) == CALRT_OK);
      CHECK(calrt_calbin_configure(cb) == CALRT_OK);
      out[th][b] = malloc(sizeof(float) * (size_t)V * (size_t)(STEPS + 1));
      int32_t seq, idle;
      CHECK(calrt_kv_create_sequence(cb, &idle) == CALRT_OK);
      CHECK(calrt_kv_create_sequence(cb, &seq) == CALRT_OK);
      calrt_job *j;
      calrt_job_result r;
      CHECK(calrt_job_create_prefill(cb, seq, prompt, P, &j) == CALRT_OK);
      CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
      CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
      memcpy(out[th][b], r.logits, sizeof(float) * (size_t)V);
      int32_t tok = argmax(r.logits, V);
      calrt_job_release(j);
      for (int k = 0; k < STEPS; k++) {
        int32_t sid[4] = {idle, idle, seq, idle}, tk[4] = {1, 2, tok, 3}, ps[4] = {0, 0, P + k, 0};
        uint8_t va[4] = {0, 0, 1, 0};
        const int lane = b ? 2 : 0, lanes = b ? 4 : 1;
        CHECK(calrt_job_create_decode(cb, b ? sid : &seq, b ? tk : &tok, b ? ps : &ps[2], b ? va : &va[2],
                                      lanes, &j) == CALRT_OK);
        CHECK(run(j, k % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_JOB_OK);
        CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
        memcpy(out[th][b] + (size_t)(k + 1) * V, r.logits + (size_t)lane * V, sizeof(float) * (size_t)V);
        tok = argmax(r.logits + (size_t)lane * V, V);
        calrt_job_release(j);
      }
      CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
    }
    CHECK(calrt_device_close(dev) == CALRT_OK);
  }
  const size_t n = sizeof(float) * (size_t)V * (size_t)(STEPS + 1);
  CHECK(memcmp(out[0][0], out[0][1], n) == 0); /* B1 == B4 lane 2, one thread */
  CHECK(memcmp(out[0][0], out[1][0], n) == 0); /* 1 thread == 3 threads */
  CHECK(memcmp(out[0][0], out[1][1], n) == 0);
  for (int i = 0; i < 4; i++) free(out[i / 2][i % 2]);
  unsetenv("CALRT_SIM_THREADS");
  free_model(&tm);
}

/* Gemma 3 (embedding scale, q/k norms, the attention's and the MLP's output norms, GELU, its score
 * scale) with sliding layers of their own RoPE base (pattern 2: layer 0 slides with a window of 8,
 * layer 1 is global), big enough for the worker pool: a 40-token prefill and 4 decode steps give
 * bitwise the same logits at B1 and in lane 9 of a B16 job, on 1 and 3 kernel threads. The B16 job's
 * other active lanes are other sequences at other positions (inside and past the window), so the
 * attention tasks around lane 9's (and the K rows their workers prefetch for the next task) have
 * windows of their own. */
static void test_gemma_batch(void) {
  test_model tm;
  make_model_desc(&tm, (calrt_model_desc){300, 128, 1024, 2, 4, 2, 32, 1e-6f, 1000000.0, 1, CALRT_ARCH_GEMMA3,
                                          8, 2, 10000.0, 48.0f, 8.0f, 0.0f, 0.0f});
  enum { STEPS = 4, P = 40, B = 16, LANE = 9 };
  const int V = tm.m.vocab_size, active[4] = {0, 3, LANE, 15};
  float *out[2][2]; /* [threads 1/3][B1 / B16 lane 9] */
  int32_t prompt[P];
  for (int i = 0; i < P; i++) prompt[i] = (i * 37 + 11) % V;
  for (int th = 0; th < 2; th++) {
    calrt_device *dev = open_sim_threads(th ? 3 : 1);
    calrt_profile prof[2] = {{1, 64, 2, CALRT_KV_FP32, 1, 0}, {B, 64, B + 1, CALRT_KV_FP32, 1, 0}};
    calrt_timing t0 = {0};
    for (int b = 0; b < 2; b++) {
      calrt_calbin *cb;
      CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &prof[b], &t0, &cb) == CALRT_OK);
      CHECK(calrt_calbin_configure(cb) == CALRT_OK);
      out[th][b] = malloc(sizeof(float) * (size_t)V * (STEPS + 1));
      int32_t seq[B], tok[B], idle;
      CHECK(calrt_kv_create_sequence(cb, &idle) == CALRT_OK);
      calrt_job *j;
      calrt_job_result r;
      for (int a = 0; a < (b ? 4 : 1); a++) { /* B1: lane 9's sequence alone */
        const int lane = b ? active[a] : LANE, n = lane == LANE ? P : 3 + 2 * lane;
        int32_t other[P];
        for (int i = 0; i < n; i++) other[i] = (i * 13 + lane) % V;
        CHECK(calrt_kv_create_sequence(cb, &seq[lane]) == CALRT_OK);
        CHECK(calrt_job_create_prefill(cb, seq[lane], lane == LANE ? prompt : other, n, &j) == CALRT_OK);
        CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
        CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
        if (lane == LANE) memcpy(out[th][b], r.logits, sizeof(float) * (size_t)V);
        tok[lane] = argmax(r.logits, V);
        calrt_job_release(j);
      }
      for (int k = 0; k < STEPS; k++) {
        int32_t sid[B], tk[B], ps[B];
        uint8_t va[B] = {0};
        for (int l = 0; l < B; l++) { sid[l] = idle; tk[l] = 1; ps[l] = 0; }
        for (int a = 0; a < (b ? 4 : 1); a++) {
          const int lane = b ? active[a] : LANE;
          sid[lane] = seq[lane];
          tk[lane] = tok[lane];
          CHECK(calrt_kv_committed_len(cb, seq[lane], &ps[lane]) == CALRT_OK);
          va[lane] = 1;
        }
        if (b) CHECK(calrt_job_create_decode(cb, sid, tk, ps, va, B, &j) == CALRT_OK);
        else CHECK(calrt_job_create_decode(cb, &sid[LANE], &tk[LANE], &ps[LANE], &va[LANE], 1, &j) == CALRT_OK);
        CHECK(run(j, k % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_JOB_OK);
        CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
        for (int a = 0; a < (b ? 4 : 1); a++) {
          const int lane = b ? active[a] : LANE;
          const float *row = r.logits + (size_t)(b ? lane : 0) * V;
          for (int v = 0; v < V; v++) CHECK(isfinite(row[v]));
          if (lane == LANE) memcpy(out[th][b] + (size_t)(k + 1) * V, row, sizeof(float) * (size_t)V);
          tok[lane] = argmax(row, V);
        }
        calrt_job_release(j);
      }
      CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
    }
    CHECK(calrt_device_close(dev) == CALRT_OK);
  }
  const size_t n = sizeof(float) * (size_t)V * (STEPS + 1);
  CHECK(memcmp(out[0][0], out[0][1], n) == 0); /* B1 == B16 lane 9, one thread */
  CHECK(memcmp(out[0][0], out[1][0], n) == 0); /* 1 thread == 3 threads */
  CHECK(memcmp(out[0][0], out[1][1], n) == 0);
  for (int i = 0; i < 4; i++) free(out[i / 2][i % 2]);
  unsetenv("CALRT_SIM_THREADS");
  free_model(&tm);
}

/* Sliding windows of `arch` with every layer sliding (pattern 0), window W, L layers: what position p
 * computes depends on positions [p - L (W - 1), p] only. Two sequences that differ in their first token
 * alone, decoded side by side as lanes of a B4 job (a 2-token prefill, then one token a step), give
 * bitwise the same logits at every position p > L (W - 1) and different ones at p = L (W - 1) (so the
 * window is neither wider nor narrower than W); without the window the last position differs too. */
static void test_sliding_window(int arch) {
  enum { W = 4, L = 3, LAST = 16 };
  test_model tm;
  const double local = arch == CALRT_ARCH_GEMMA3 ? 10000.0 : 0.0; /* (Gemma 2: one RoPE base) */
  make_model_desc(&tm, (calrt_model_desc){61, 24, 40, L, 4, 2, 8, 1e-6f, 1000000.0, 1, arch, W, 0, local,
                                          arch != CALRT_ARCH_LLAMA ? 12.0f : 0.0f, 0.0f, 0.0f, 0.0f});
  const int V = tm.m.vocab_size;
  calrt_device *dev;
  calrt_open_params op = {.profile = "sim-next", .dram_bytes = 64u << 20};
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  calrt_profile p4 = {4, 32, 5, CALRT_KV_BF16, 1, 0};
  calrt_timing t0 = {0};
  float *lg[2][2]; /* [window on/off][sequence]: logits at positions 1..LAST */
  for (int win = 0; win < 2; win++) {
    calrt_model_desc md = tm.m;
    if (win) md.sliding_window = 0;
    calrt_calbin *cb;
    CHECK(calrt_calbin_create(dev, 0, &md, tm.t, (size_t)tm.n, &p4, &t0, &cb) == CALRT_OK);
    CHECK(calrt_calbin_configure(cb) == CALRT_OK);
    int32_t seq[2], idle;
    CHECK(calrt_kv_create_sequence(cb, &idle) == CALRT_OK);
    calrt_job *j;
    calrt_job_result r;
    for (int s = 0; s < 2; s++) {
      lg[win][s] = malloc(sizeof(float) * (size_t)V * (LAST + 1));
      int32_t two[2] = {s ? 7 : 50, 3};
      CHECK(calrt_kv_create_sequence(cb, &seq[s]) == CALRT_OK);
      CHECK(calrt_job_create_prefill(cb, seq[s], two, 2, &j) == CALRT_OK);
      CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
      CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
      memcpy(lg[win][s] + (size_t)V, r.logits, sizeof(float) * (size_t)V);
      calrt_job_release(j);
    }
    for (int p = 2; p <= LAST; p++) { /* both sequences are fed the same token at p */
      int32_t sid[4] = {seq[0], idle, seq[1], idle}, tk[4] = {(p * 29) % V, 1, (p * 29) % V, 1};
      int32_t ps[4] = {p, 0, p, 0};
      uint8_t va[4] = {1, 0, 1, 0};
      CHECK(calrt_job_create_decode(cb, sid, tk, ps, va, 4, &j) == CALRT_OK);
      CHECK(run(j, p % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_JOB_OK);
      CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
      memcpy(lg[win][0] + (size_t)p * V, r.logits, sizeof(float) * (size_t)V);
      memcpy(lg[win][1] + (size_t)p * V, r.logits + 2 * (size_t)V, sizeof(float) * (size_t)V);
      calrt_job_release(j);
    }
    CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
  }
  const size_t row = sizeof(float) * (size_t)V;
  for (int p = 1; p <= LAST; p++) {
    const int same = memcmp(lg[0][0] + (size_t)p * V, lg[0][1] + (size_t)p * V, row) == 0;
    if (p > L * (W - 1)) CHECK(same);
    if (p == L * (W - 1)) CHECK(!same);
  }
  CHECK(memcmp(lg[1][0] + (size_t)LAST * V, lg[1][1] + (size_t)LAST * V, row) != 0);
  /* a negative window is refused */
  calrt_model_desc bad = tm.m;
  bad.sliding_window = -1;
  calrt_calbin *cb;
  CHECK(calrt_calbin_create(dev, 0, &bad, tm.t, (size_t)tm.n, &p4, &t0, &cb) == CALRT_E_INVALID_ARGUMENT);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  for (int i = 0; i < 4; i++) free(lg[i / 2][i % 2]);
  free_model(&tm);
}

/* One fixed schedule of `md` on a B4 calbin: sequence A's 40-token prefill, B's 5-token one, then
 * SC_STEPS decode steps of both (lanes 0 and 2, fixed tokens: every run computes the same positions).
 * Logits rows into out[2 + 2 * SC_STEPS][V]: A's prefill, B's, then each step's lane 0 and lane 2. */
enum { SC_STEPS = 4, SC_ROWS = 2 + 2 * SC_STEPS };
static void softcap_run(calrt_device *dev, const test_model *tm, const calrt_model_desc *md, float *out) {
  const int V = md->vocab_size;
  calrt_profile p4 = {4, 64, 5, CALRT_KV_BF16, 1, 0};
  calrt_timing t0 = {0};
  calrt_calbin *cb;
  CHECK(calrt_calbin_create(dev, 0, md, tm->t, (size_t)tm->n, &p4, &t0, &cb) == CALRT_OK);
  CHECK(calrt_calbin_configure(cb) == CALRT_OK);
  int32_t seq[2], idle, toks[40];
  CHECK(calrt_kv_create_sequence(cb, &idle) == CALRT_OK);
  calrt_job *j;
  calrt_job_result r;
  for (int s = 0; s < 2; s++) {
    const int n = s ? 5 : 40;
    for (int i = 0; i < n; i++) toks[i] = (i * 37 + 11 + 5 * s) % V;
    CHECK(calrt_kv_create_sequence(cb, &seq[s]) == CALRT_OK);
    CHECK(calrt_job_create_prefill(cb, seq[s], toks, n, &j) == CALRT_OK);
    CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
    memcpy(out + (size_t)s * V, r.logits, sizeof(float) * (size_t)V);
    calrt_job_release(j);
  }
  for (int k = 0; k < SC_STEPS; k++) {
    int32_t sid[4] = {seq[0], idle, seq[1], idle}, tk[4] = {(k * 29 + 3) % V, 1, (k * 31 + 7) % V, 1};
    int32_t ps[4] = {40 + k, 0, 5 + k, 0};
    uint8_t va[4] = {1, 0, 1, 0};
    CHECK(calrt_job_create_decode(cb, sid, tk, ps, va, 4, &j) == CALRT_OK);
    CHECK(run(j, k % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
    memcpy(out + (size_t)(2 + 2 * k) * V, r.logits, sizeof(float) * (size_t)V);
    memcpy(out + (size_t)(3 + 2 * k) * V, r.logits + 2 * (size_t)V, sizeof(float) * (size_t)V);
    calrt_job_release(j);
  }
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

/* Gemma 2 (Gemma 3 without q/k norms: 11 tensors a layer; layer 0 slides, window 8) and logit
 * soft-capping, big enough for the worker pool. With final_logit_softcapping c (half the largest raw
 * logit: it bites), every logit is bitwise c * tanhf(raw / c), raw the same model's logit without the
 * cap, and lies in (-c, c). With attn_logit_softcapping 2^100 (~1.3e30) the logits are bitwise the
 * uncapped ones: s / 2^100 and the product by 2^100 are exact (a power of two; scores of magnitude
 * above 2^-26 stay normal) and tanhf(x) = x for such tiny x. (1e30 itself is not: s / 1e30 * 1e30
 * rounds away from s for about one score in eight.) A small attention cap (0.5) changes the logits,
 * and those runs are bitwise deterministic, on 1 and 3 threads. Caps below zero, NaN or infinite are
 * refused, each named; a calbin of other caps cannot share the KV of one without. */
static void test_softcap(void) {
  test_model tm;
  make_model_desc(&tm, (calrt_model_desc){300, 128, 1024, 2, 4, 2, 32, 1e-6f, 10000.0, 1, CALRT_ARCH_GEMMA2, 8, 2,
                                          0.0, 48.0f, 0.0f, 0.0f, 0.0f});
  CHECK(tm.n == 1 + 2 * 11 + 1); /* embedding, 11 a layer, final norm (tied head) */
  const int V = tm.m.vocab_size;
  const size_t n = (size_t)SC_ROWS * V;
  float *raw = malloc(sizeof(float) * n), *fin = malloc(sizeof(float) * n), *huge = malloc(sizeof(float) * n);
  float *both[3] = {malloc(sizeof(float) * n), malloc(sizeof(float) * n), malloc(sizeof(float) * n)};
  calrt_device *dev = open_sim_threads(1);
  softcap_run(dev, &tm, &tm.m, raw);
  float mx = 0.f;
  for (size_t i = 0; i < n; i++) {
    CHECK(isfinite(raw[i]));
    if (fabsf(raw[i]) > mx) mx = fabsf(raw[i]);
  }
  const float c = mx / 2;
  calrt_model_desc md = tm.m;
  md.final_logit_softcapping = c;
  softcap_run(dev, &tm, &md, fin);
  for (size_t i = 0; i < n; i++) {
    const float want = c * tanhf(raw[i] / c);
    CHECK(memcmp(&fin[i], &want, sizeof want) == 0);
    CHECK(fin[i] > -c && fin[i] < c);
  }
  md = tm.m;
  md.attn_logit_softcapping = 0x1p100f;
  softcap_run(dev, &tm, &md, huge);
  CHECK(memcmp(huge, raw, sizeof(float) * n) == 0);
  md.attn_logit_softcapping = 0.5f;
  md.final_logit_softcapping = c;
  softcap_run(dev, &tm, &md, both[0]);
  softcap_run(dev, &tm, &md, both[1]);
  CHECK(memcmp(both[0], fin, sizeof(float) * n) != 0); /* the attention cap moved them */
  CHECK(memcmp(both[0], both[1], sizeof(float) * n) == 0);
  for (size_t i = 0; i < n; i++) CHECK(both[0][i] > -c && both[0][i] < c);
  /* the shared-KV check names the caps */
  calrt_profile p1 = {1, 64, 2, CALRT_KV_BF16, 1, 0};
  calrt_timing t0 = {0};
  calrt_calbin *o, *other;
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p1, &t0, &o) == CALRT_OK);
  CHECK(calrt_calbin_configure(o) == CALRT_OK);
  for (int f = 0; f < 2; f++) {
    md = tm.m;
    if (f) md.final_logit_softcapping = c;
    else md.attn_logit_softcapping = 50.f;
    CHECK(calrt_calbin_create(dev, 0, &md, tm.t, (size_t)tm.n, &p1, &t0, &other) == CALRT_OK);
    CHECK(calrt_calbin_share_kv(other, o) == CALRT_E_INVALID_ARGUMENT &&
          ERR_HAS(f ? "final_logit_softcapping" : "attn_logit_softcapping"));
    CHECK(calrt_calbin_destroy(other) == CALRT_OK);
  }
  CHECK(calrt_calbin_destroy(o) == CALRT_OK);
  const float bad[3] = {-1.f, NAN, INFINITY};
  for (int f = 0; f < 2; f++)
    for (int b = 0; b < 3; b++) {
      md = tm.m;
      if (f) md.final_logit_softcapping = bad[b];
      else md.attn_logit_softcapping = bad[b];
      CHECK(calrt_calbin_create(dev, 0, &md, tm.t, (size_t)tm.n, &p1, &t0, &other) == CALRT_E_INVALID_ARGUMENT &&
            ERR_HAS(f ? "final_logit_softcapping" : "attn_logit_softcapping"));
    }
  CHECK(calrt_device_close(dev) == CALRT_OK);
  dev = open_sim_threads(3);
  md = tm.m;
  md.attn_logit_softcapping = 0.5f;
  md.final_logit_softcapping = c;
  softcap_run(dev, &tm, &md, both[2]);
  CHECK(memcmp(both[0], both[2], sizeof(float) * n) == 0); /* 1 thread == 3 threads */
  CHECK(calrt_device_close(dev) == CALRT_OK);
  unsetenv("CALRT_SIM_THREADS");
  free(raw);
  free(fin);
  free(huge);
  for (int i = 0; i < 3; i++) free(both[i]);
  free_model(&tm);
}

/* Prompt logits (C3-style, sim-next: calrt_job_create_prefill_all) on one calbin of `tm` with profile
 * `p`, `pre` tokens already committed, prompt[0..n): lane i of the prefill-all job is bitwise the one
 * lane of an ordinary prefill of prompt[0..i] (after the same `pre` tokens) on a fresh sequence, for
 * every i; echo (job_id, seq, pre + i) and checksum of row i; committed_len pre + n afterwards; the
 * KV and a decode step after it bitwise those after an ordinary prefill of the n tokens. Why bitwise:
 * each row's computation is the same sequence of float operations whatever the job's other rows
 * (kernels.c's Invariant: the linear layers' reduction and every norm are per row, attention is per
 * (row, head) and causal, reading only the KV positions <= its own, written by rows 0..i alike), so
 * rows 0..i of both jobs compute the same bits and the final norm + lm_head of row i too — even when
 * the n-row lm_head runs on the pool and the 1-row one inline (the Llama case). null: a null-compute
 * device (no weights): lane i is the pseudo-logits of (prompt[i], pre + i), i.e. again the lane of
 * the ordinary prefill of prompt[0..i]. */
static void prefill_all_case(calrt_device *dev, const test_model *tm, const calrt_profile *p, int pre,
                             const int32_t *prompt, int n, int null) {
  const int V = tm->m.vocab_size;
  const size_t row = sizeof(float) * (size_t)V;
  calrt_timing t0 = {0};
  calrt_calbin *cb;
  CHECK(calrt_calbin_create(dev, 0, &tm->m, null ? NULL : tm->t, null ? 0 : (size_t)tm->n, p, &t0, &cb) ==
        CALRT_OK);
  CHECK(calrt_calbin_configure(cb) == CALRT_OK);
  int32_t head[4] = {7, 3, 5, 1}; /* the tokens committed before the prompt (pre <= 4) */
  calrt_job *j;
  calrt_job_result r;
  int32_t a, b, len;
  CHECK(calrt_kv_create_sequence(cb, &a) == CALRT_OK);
  CHECK(calrt_kv_create_sequence(cb, &b) == CALRT_OK);
  for (int s = 0; s < 2 && pre > 0; s++) {
    CHECK(calrt_job_create_prefill(cb, s ? b : a, head, pre, &j) == CALRT_OK);
    CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
    calrt_job_release(j);
  }
  calrt_job *all;
  CHECK(calrt_job_create_prefill_all(cb, a, prompt, n, &all) == CALRT_OK);
  CHECK(run(all, CALRT_ENGINE_PONG) == CALRT_JOB_OK);
  calrt_job_result ra;
  CHECK(calrt_job_result_get(all, &ra) == CALRT_OK);
  CHECK(ra.lanes == n && ra.vocab == V && ra.status == CALRT_JOB_OK);
  CHECK(calrt_kv_committed_len(cb, a, &len) == CALRT_OK && len == pre + n);
  for (int i = 0; i < n; i++) {
    const float *ri = ra.logits + (size_t)i * V;
    CHECK(ra.echo[3 * i] == ra.job_id && ra.echo[3 * i + 1] == a && ra.echo[3 * i + 2] == pre + i);
    CHECK(ra.checksum[i] == calrt_checksum(ri, row));
    for (int v = 0; v < V; v++) CHECK(isfinite(ri[v]));
    if (i > 0) CHECK(memcmp(ri, ri - V, row) != 0); /* each row its own position's logits */
    int32_t s;
    CHECK(calrt_kv_create_sequence(cb, &s) == CALRT_OK);
    if (pre > 0) {
      CHECK(calrt_job_create_prefill(cb, s, head, pre, &j) == CALRT_OK);
      CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
      calrt_job_release(j);
    }
    CHECK(calrt_job_create_prefill(cb, s, prompt, i + 1, &j) == CALRT_OK);
    CHECK(run(j, i % 2 ? CALRT_ENGINE_PONG : CALRT_ENGINE_PING) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK && r.lanes == 1);
    CHECK(r.echo[2] == pre + i);
    CHECK(memcmp(r.logits, ri, row) == 0);
    calrt_job_release(j);
    CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  }
  /* The ordinary prefill of all n tokens: its lane is the prefill-all's last, its KV the same. */
  CHECK(calrt_job_create_prefill(cb, b, prompt, n, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
  CHECK(memcmp(r.logits, ra.logits + (size_t)(n - 1) * V, row) == 0);
  calrt_job_release(j);
  calrt_job_release(all);
  if (!null) {
    size_t kvn = 0;
    CHECK(calrt_sim_read_kv(cb, a, NULL, &kvn) == CALRT_OK && kvn > 0);
    unsigned char *ka = malloc(kvn), *kb = malloc(kvn);
    CHECK(calrt_sim_read_kv(cb, a, ka, &kvn) == CALRT_OK && calrt_sim_read_kv(cb, b, kb, &kvn) == CALRT_OK);
    CHECK(memcmp(ka, kb, kvn) == 0);
    free(ka);
    free(kb);
  }
  float *step = malloc(2 * row);
  for (int s = 0; s < 2; s++) { /* then a decode step of each: bitwise the same logits */
    int32_t seq[4] = {s ? b : a, a, a, a}, tok[4] = {prompt[0], 0, 0, 0}, pos[4] = {pre + n, 0, 0, 0};
    uint8_t va[4] = {1, 0, 0, 0}; /* lane 0 of the profile's B */
    CHECK(calrt_job_create_decode(cb, seq, tok, pos, va, p->compiled_batch, &j) == CALRT_OK);
    CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
    CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
    memcpy(step + (size_t)s * V, r.logits, row);
    calrt_job_release(j);
    CHECK(calrt_kv_committed_len(cb, seq[0], &len) == CALRT_OK && len == pre + n + 1);
  }
  CHECK(memcmp(step, step + V, row) == 0);
  free(step);
  CHECK(calrt_kv_free_sequence(cb, a) == CALRT_OK);
  CHECK(calrt_kv_free_sequence(cb, b) == CALRT_OK);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
}

/* Prompt logits: the bitwise cases above (tiny Qwen3 fp32 and bf16 KV, a Llama on 3 kernel threads,
 * null compute), the refusals, the sequence counted once while in flight, faults (CCU: sequence
 * unknown, every lane zeroed; crosstalk: one lane's checksum off), INVALID at execution, and
 * calrt-0.7.6's NOT_SUPPORTED. */
static void test_prompt_logits(void) {
  test_model tm;
  make_model(&tm, 0);
  const int32_t prompt[7] = {11, 4, 60, 4, 0, 33, 17};
  calrt_open_params op = {.profile = "sim-next", .dram_bytes = 64u << 20};
  calrt_device *dev;
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  calrt_device_info di;
  CHECK(calrt_device_info_get(dev, &di) == CALRT_OK && di.prompt_logits == 1);
  calrt_profile pf = {1, 24, 4, CALRT_KV_FP32, 1, 0}, pb = {1, 24, 4, CALRT_KV_BF16, 1, 0};
  calrt_profile p4 = {4, 24, 4, CALRT_KV_BF16, 1, 0}; /* a B4 calbin's prefill-all: n lanes all the same */
  prefill_all_case(dev, &tm, &pf, 0, prompt, 7, 0);
  prefill_all_case(dev, &tm, &pb, 3, prompt, 7, 0);
  prefill_all_case(dev, &tm, &p4, 2, prompt, 7, 0);
  prefill_all_case(dev, &tm, &pf, 1, prompt, 1, 0); /* one token: the ordinary prefill's one lane */

  /* Refusals (the ordinary prefill's checks), the sequence in use once, faults, INVALID. */
  calrt_timing t0 = {0};
  calrt_calbin *cb;
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &pf, &t0, &cb) == CALRT_OK);
  CHECK(calrt_calbin_configure(cb) == CALRT_OK);
  calrt_job *j;
  calrt_job_result r;
  calrt_job_status st;
  int32_t s, len, big[25] = {0}, badtok[2] = {1, 61};
  int valid = 1;
  CHECK(calrt_kv_create_sequence(cb, &s) == CALRT_OK);
  CHECK(calrt_job_create_prefill_all(cb, s, prompt, 0, &j) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("at least one"));
  CHECK(calrt_job_create_prefill_all(cb, s, big, 25, &j) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("max_seq"));
  CHECK(calrt_job_create_prefill_all(cb, s, badtok, 2, &j) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("tokens[1]"));
  CHECK(calrt_job_create_prefill_all(cb, 9, prompt, 2, &j) == CALRT_E_INVALID_ARGUMENT && ERR_HAS("seq_id"));
  CHECK(calrt_job_create_prefill_all(cb, s, NULL, 2, &j) == CALRT_E_INVALID_ARGUMENT);
  /* A hung prefill-all holds its sequence once (one user, not n), then a reset aborts it: zeros. */
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_TIMEOUT, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_prefill_all(cb, s, prompt, 7, &j) == CALRT_OK);
  CHECK(calrt_job_submit(j, CALRT_ENGINE_PING) == CALRT_OK);
  CHECK(calrt_job_wait(j, 20000, &st) == CALRT_E_TIMEOUT);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_E_IN_USE && ERR_HAS("used by 1 job(s)"));
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
  CHECK(calrt_job_wait(j, -1, &st) == CALRT_OK && st == CALRT_JOB_ABORTED);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK && r.lanes == 7);
  for (int i = 0; i < 7; i++) {
    CHECK(r.checksum[i] == 0 && r.echo[3 * i] == r.job_id && r.echo[3 * i + 1] == s);
    for (int v = 0; v < tm.m.vocab_size; v++) CHECK(r.logits[(size_t)i * tm.m.vocab_size + v] == 0.0f);
  }
  calrt_job_release(j);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK); /* no user left */
  /* CCU fault: the sequence unknown as after an ordinary prefill's, every lane zeroed, chip faulted. */
  CHECK(calrt_kv_create_sequence(cb, &s) == CALRT_OK);
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PONG, CALRT_SIM_FAULT_CCU, 1, 0) == CALRT_OK);
  CHECK(calrt_job_create_prefill_all(cb, s, prompt, 5, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PONG) == CALRT_JOB_CCU_FAULT);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK && r.lanes == 5);
  for (int i = 0; i < 5; i++) CHECK(r.checksum[i] == 0 && r.logits[(size_t)i * tm.m.vocab_size] == 0.0f);
  calrt_job_release(j);
  CHECK(calrt_kv_sequence_valid(cb, s, &valid) == CALRT_OK && !valid);
  CHECK(calrt_kv_committed_len(cb, s, &len) == CALRT_E_SEQUENCE_INVALID);
  int f = 0, nr = 0;
  CHECK(calrt_device_state(dev, 0, &f, &nr) == CALRT_OK && f && !nr);
  CHECK(calrt_device_reset(dev, 0) == CALRT_OK);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  /* Crosstalk on lane 3: that lane's row no longer hashes to its checksum, the others do. */
  CHECK(calrt_kv_create_sequence(cb, &s) == CALRT_OK);
  CHECK(calrt_sim_inject_fault(dev, 0, CALRT_ENGINE_PING, CALRT_SIM_FAULT_CROSSTALK, 1, 3) == CALRT_OK);
  CHECK(calrt_job_create_prefill_all(cb, s, prompt, 7, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_OK);
  CHECK(calrt_job_result_get(j, &r) == CALRT_OK);
  for (int i = 0; i < 7; i++)
    CHECK((calrt_checksum(r.logits + (size_t)i * tm.m.vocab_size, sizeof(float) * (size_t)tm.m.vocab_size) ==
           r.checksum[i]) == (i != 3));
  calrt_job_release(j);
  CHECK(calrt_kv_committed_len(cb, s, &len) == CALRT_OK && len == 7);
  /* INVALID at execution (committed 7 + 20 > max_seq 24): nothing written or committed. */
  CHECK(calrt_job_create_prefill_all(cb, s, big, 20, &j) == CALRT_OK);
  CHECK(run(j, CALRT_ENGINE_PING) == CALRT_JOB_INVALID);
  calrt_job_release(j);
  CHECK(calrt_kv_committed_len(cb, s, &len) == CALRT_OK && len == 7);
  CHECK(calrt_kv_free_sequence(cb, s) == CALRT_OK);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
  CHECK(calrt_device_close(dev) == CALRT_OK);

  /* Null compute (no weights): pseudo-logits per lane, again the ordinary prefills' lanes. */
  CHECK(calrt_device_open(&op, &dev) == CALRT_OK);
  CHECK(calrt_sim_configure(dev, 1, 0, 0) == CALRT_OK);
  prefill_all_case(dev, &tm, &pf, 2, prompt, 7, 1);
  CHECK(calrt_device_close(dev) == CALRT_OK);

  /* calrt-0.7.6: no prompt logits. */
  calrt_open_params old = {.profile = "calrt-0.7.6", .dram_bytes = 64u << 20};
  CHECK(calrt_device_open(&old, &dev) == CALRT_OK);
  CHECK(calrt_device_info_get(dev, &di) == CALRT_OK && di.prompt_logits == 0);
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &pf, &t0, &cb) == CALRT_OK);
  CHECK(calrt_calbin_configure(cb) == CALRT_OK);
  CHECK(calrt_kv_create_sequence(cb, &s) == CALRT_OK);
  j = NULL;
  CHECK(calrt_job_create_prefill_all(cb, s, prompt, 3, &j) == CALRT_E_NOT_SUPPORTED && ERR_HAS("prompt logits") &&
        j == NULL);
  CHECK(calrt_calbin_destroy(cb) == CALRT_OK);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  free_model(&tm);

  /* A Llama on 3 kernel threads, a 40-token prompt: the prefill-all's 40-row lm_head runs on the pool,
   * each reference prefill's 1-row one inline — still bitwise. */
  make_llama(&tm, 0, CALRT_ARCH_LLAMA);
  int32_t lp[40];
  for (int i = 0; i < 40; i++) lp[i] = (i * 37 + 11) % tm.m.vocab_size;
  dev = open_sim_threads(3);
  calrt_profile pl = {1, 64, 3, CALRT_KV_FP32, 1, 0};
  prefill_all_case(dev, &tm, &pl, 4, lp, 40, 0);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  unsetenv("CALRT_SIM_THREADS");
  free_model(&tm);
}

int main(void) {
  test_llama_threads(CALRT_ARCH_LLAMA);
  test_llama_threads(CALRT_ARCH_QWEN2);
  test_gemma_batch();
  test_sliding_window(CALRT_ARCH_LLAMA);
  test_sliding_window(CALRT_ARCH_GEMMA3);
  test_sliding_window(CALRT_ARCH_GEMMA2);
  test_softcap();
  test_prompt_logits();
  calrt_device *dev = NULL, *dev2 = NULL;
  test_boards();
  calrt_open_params op = {.profile = "sim-next", .dram_bytes = 64u << 20};
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
  test_shared_kv(dev, &tm);
  int cfd = test_completion_fd(dev, &tm);
  CHECK(calrt_device_close(dev) == CALRT_OK);
  errno = 0;
  CHECK(fcntl(cfd, F_GETFD) == -1 && errno == EBADF); /* closed with the device */

  calrt_open_params old = {.profile = "calrt-0.7.6", .dram_bytes = 64u << 20};
  CHECK(calrt_device_open(&old, &dev) == CALRT_OK);
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p4, &t0, &c4) == CALRT_E_NOT_SUPPORTED);
  CHECK(calrt_calbin_create(dev, 1, &tm.m, tm.t, (size_t)tm.n, &p1, &t0, &c1) == CALRT_E_NOT_SUPPORTED);
  calrt_calbin *a, *b;
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p1, &t0, &a) == CALRT_OK);
  CHECK(calrt_calbin_create(dev, 0, &tm.m, tm.t, (size_t)tm.n, &p1, &t0, &b) == CALRT_OK);
  CHECK(calrt_calbin_configure(a) == CALRT_OK);
  CHECK(calrt_calbin_share_kv(b, a) == CALRT_E_NOT_SUPPORTED && ERR_HAS("shared KV"));
  calrt_device_info di;
  CHECK(calrt_device_info_get(dev, &di) == CALRT_OK && !di.shared_kv);
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
