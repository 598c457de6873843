/* pool.c — the worker threads an engine uses inside one job (the kernels split output rows over them).
 *
 * An engine's worker thread owns its pool: it creates it on the first job that computes, runs every
 * parallel region itself (it takes tasks too, as worker 0) and destroys it when it exits. A region is
 * a set of independent tasks claimed with an atomic counter tagged with the region's number;
 * sim_pool_run returns once every task has finished (an atomic count each task bumps after its
 * writes), so the caller sees every task's writes. It never waits for a helper that has not started
 * a task: on a loaded host a helper may wake late, and then simply finds nothing left to do.
 * Which thread runs a task never changes what it computes: each task writes its own outputs with its
 * own fixed order of operations. sim_pool_run_ahead claims each worker's tasks one ahead and tells
 * the running task which one comes next on its thread (attention prefetches that task's K rows).
 *
 * Size: CALRT_SIM_THREADS (1 = no helpers, the old single-threaded kernels), else the CPUs the engine's
 * thread may run on (sim_usable_cpus), at most SIM_POOL_MAX.
 */
#include <sched.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

struct sim_pool {
  int n_threads; /* including the owner */
  pthread_t *th;
  pthread_mutex_t mu;
  pthread_cond_t go, done;
  /* The current region, published by `gen` (release): fn/ctx/n_tasks are written while the claim
   * counter is closed for the new region (so a helper still holding an older region's values can
   * never claim with them), then the counter opens and gen moves on. */
  atomic_ullong gen;
  _Atomic(sim_task_fn) fn;
  _Atomic(void *) ctx;
  _Atomic(int *) next; /* sim_pool_run_ahead's array, else NULL */
  atomic_int n_tasks;
  atomic_int stop;
  atomic_int sleepers; /* helpers blocked on `go` (or about to): the owner signals only then */
  /* (region number << 32) | next task: a claim succeeds only for the region it was read for, so a
   * helper that wakes late can never run a task of a newer region with an older region's fn/ctx. */
  atomic_ullong claim;
  atomic_int finished; /* tasks of the current region that have returned */
  atomic_int workers;  /* threads that take part in the current region (workers 0..workers-1) */
  const atomic_int *share; /* sim_pool_share: the engines computing now (NULL: the CPUs are ours) */
  void *scratch;       /* sim_pool_scratch (the owner's only) */
  double wait_us;      /* CALRT_SIM_PROFILE: owner only (sim_pool_wait_us) */
  long long regions;
  size_t scratch_bytes;
};

typedef struct helper_arg {
  sim_pool *pool;
  int worker;
} helper_arg;

#define CLAIM_CLOSED 0xFFFFFFFFull

/* A few microseconds of busy waiting before a thread blocks: a decode step runs ~120 regions a few
 * microseconds apart, and a futex wake-up per region costs more than the gap. Bounded, so an idle
 * engine's helpers sleep and cost the host nothing. */
#define SPIN_NS 30000

static double now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

/* The next task of region `gen`, or -1 when none is left. */
static int claim_one(sim_pool *p, uint64_t gen, int n_tasks) {
  unsigned long long c = atomic_load(&p->claim);
  for (;;) {
    if ((c >> 32) != (gen & 0xFFFFFFFFu) || (long long)(c & 0xFFFFFFFFu) >= n_tasks) return -1;
    if (atomic_compare_exchange_weak(&p->claim, &c, c + 1)) return (int)(c & 0xFFFFFFFFu); /* else c reloaded */
  }
}

/* Run tasks of region `gen` until none is left. With `next` (sim_pool_run_ahead), each task but the
 * region's last few is claimed one task ahead: next[worker] holds the task this worker runs after
 * the current one, -1 when that is not decided yet. */
static void claim_tasks(sim_pool *p, uint64_t gen, sim_task_fn fn, void *ctx, int n_tasks, int worker,
                        int *next) {
  int t = claim_one(p, gen, n_tasks);
  while (t >= 0) {
    /* none claimed ahead among a region's last n_threads tasks: a worker holding one while the
     * others run out of work would leave them idle (the tail is claimed one at a time) */
    const int nt = next && t + p->n_threads < n_tasks ? claim_one(p, gen, n_tasks - p->n_threads) : -1;
    if (next) next[worker] = nt;
    fn(ctx, t, worker);
    if (atomic_fetch_add(&p->finished, 1) + 1 == n_tasks) { /* the region's last task */
      pthread_mutex_lock(&p->mu);
      pthread_cond_signal(&p->done);
      pthread_mutex_unlock(&p->mu);
    }
    t = nt >= 0 ? nt : claim_one(p, gen, n_tasks);
  }
}

static void *helper(void *arg) {
  helper_arg a = *(helper_arg *)arg;
  free(arg);
  sim_pool *p = a.pool;
  uint64_t seen = 0;
  int left_out = 0; /* the last region ran on fewer threads than this one: sleep without spinning */
  for (;;) {
    uint64_t g = atomic_load(&p->gen);
    if (g == seen && !atomic_load(&p->stop) && !left_out) {
      const double t0 = now_ns();
      for (int i = 1; (g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop); i++) {
        sim_cpu_relax();
        if ((i & 255) == 0 && now_ns() - t0 > SPIN_NS) break;
      }
    }
    if (g == seen && !atomic_load(&p->stop)) {
      pthread_mutex_lock(&p->mu);
      atomic_fetch_add(&p->sleepers, 1);
      while ((g = atomic_load(&p->gen)) == seen && !atomic_load(&p->stop)) pthread_cond_wait(&p->go, &p->mu);
      atomic_fetch_sub(&p->sleepers, 1);
      pthread_mutex_unlock(&p->mu);
    }
    if (atomic_load(&p->stop)) break;
    seen = g;
    sim_task_fn fn = atomic_load(&p->fn);
    void *ctx = atomic_load(&p->ctx);
    int *next = atomic_load(&p->next);
    int n = atomic_load(&p->n_tasks);
    left_out = a.worker >= atomic_load(&p->workers); /* this region runs on fewer threads (sim_pool_share) */
    if (!left_out) claim_tasks(p, seen, fn, ctx, n, a.worker, next); /* nothing left if it woke after the others ran all */
  }
  return NULL;
}

/* The CPUs this thread may run on (its affinity mask, as `nproc` counts), else the CPUs online. A
 * process pinned to one core (a benchmark's server, one replica per core) then computes on one thread:
 * a second thread on the same core only takes turns with the first, and spins while it waits. */
long sim_usable_cpus(void) {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
  return sysconf(_SC_NPROCESSORS_ONLN);
}

int sim_pool_default_threads(void) {
  const char *env = getenv("CALRT_SIM_THREADS");
  long n = 0;
  if (env && *env) n = strtol(env, NULL, 10);
  if (n < 1) n = sim_usable_cpus();
  if (n < 1) n = 1;
  if (n > SIM_POOL_MAX) n = SIM_POOL_MAX;
  return (int)n;
}

sim_pool *sim_pool_new(int n_threads) {
  if (n_threads < 1) n_threads = 1;
  sim_pool *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  p->n_threads = 1;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->go, NULL);
  pthread_cond_init(&p->done, NULL);
  atomic_init(&p->gen, 0);
  atomic_init(&p->fn, NULL);
  atomic_init(&p->ctx, NULL);
  atomic_init(&p->next, NULL);
  atomic_init(&p->n_tasks, 0);
  atomic_init(&p->stop, 0);
  atomic_init(&p->sleepers, 0);
  atomic_init(&p->claim, CLAIM_CLOSED);
  atomic_init(&p->finished, 0);
  atomic_init(&p->workers, 1);
  if (n_threads > 1) {
    p->th = calloc((size_t)n_threads - 1, sizeof *p->th);
    if (!p->th) return p; /* runs single-threaded */
    for (int i = 1; i < n_threads; i++) {
      helper_arg *a = malloc(sizeof *a);
      if (!a) break;
      *a = (helper_arg){p, i};
      if (pthread_create(&p->th[i - 1], NULL, helper, a) != 0) {
        free(a);
        break;
      }
      p->n_threads++;
    }
  }
  return p;
}

int sim_pool_threads(const sim_pool *p) { return p ? p->n_threads : 1; }

void sim_pool_share(sim_pool *p, const atomic_int *computing) {
  if (p) p->share = computing;
}

/* The threads a region started now may use: all of them, or (sim_pool_share) this engine's part of
 * the CPUs while other engines compute too. Two engines on a 2-CPU host, both computing (PING/PONG
 * under load): each job on one thread; helpers of both spinning and taking turns on the same two
 * CPUs cost more than the split gains (SmolLM2, two B16 jobs in flight: 59.7-61.3 ms the pair with
 * two threads each, 54.3-55.3 with one; bench/README). */
static int region_threads(const sim_pool *p) {
  if (!p->share) return p->n_threads;
  const int c = atomic_load(p->share);
  if (c <= 1) return p->n_threads;
  const int n = p->n_threads / c;
  return n > 1 ? n : 1;
}

void sim_pool_run(sim_pool *p, sim_task_fn fn, void *ctx, int n_tasks) {
  sim_pool_run_ahead(p, fn, ctx, n_tasks, NULL);
}

/* The owner never waits for a helper to wake up: it runs every task nobody else claimed, and waits
 * only for tasks a helper has started (whose outputs it is about to read). */
void sim_pool_run_ahead(sim_pool *p, sim_task_fn fn, void *ctx, int n_tasks, int *next) {
  if (n_tasks <= 0) return;
  const int workers = p ? region_threads(p) : 1;
  if (workers == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; t++) {
      if (next) next[0] = t + 1 < n_tasks ? t + 1 : -1;
      fn(ctx, t, 0);
    }
    return;
  }
  const uint64_t gen = atomic_load(&p->gen) + 1; /* only the owner writes gen */
  const unsigned long long tag = (unsigned long long)(gen & 0xFFFFFFFFu) << 32;
  atomic_store(&p->claim, tag | CLAIM_CLOSED);
  atomic_store(&p->fn, fn);
  atomic_store(&p->ctx, ctx);
  atomic_store(&p->next, next);
  atomic_store(&p->n_tasks, n_tasks);
  atomic_store(&p->finished, 0);
  atomic_store(&p->workers, workers);
  atomic_store(&p->claim, tag);
  atomic_store(&p->gen, gen);
  if (atomic_load(&p->sleepers) > 0) { /* seq_cst: a helper counted after this load sees gen */
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->go);
    pthread_mutex_unlock(&p->mu);
  }
  claim_tasks(p, gen, fn, ctx, n_tasks, 0, next);
  const int prof = sim_prof_enabled();
  const double w0 = prof && atomic_load(&p->finished) < n_tasks ? now_ns() : 0.0;
  if (prof) p->regions++;
  if (atomic_load(&p->finished) < n_tasks) {
    const double t0 = now_ns();
    for (int i = 1; atomic_load(&p->finished) < n_tasks; i++) {
      sim_cpu_relax();
      if ((i & 255) == 0 && now_ns() - t0 > SPIN_NS) break;
    }
  }
  if (atomic_load(&p->finished) < n_tasks) {
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->finished) < n_tasks) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
  }
  if (w0 > 0.0) p->wait_us += (now_ns() - w0) / 1e3;
}

double sim_pool_wait_us(const sim_pool *p) { return p ? p->wait_us : 0.0; }
long long sim_pool_regions(const sim_pool *p) { return p ? p->regions : 0; }

void *sim_pool_scratch(sim_pool *p, size_t bytes) {
  if (bytes <= p->scratch_bytes) return p->scratch;
  free(p->scratch);
  p->scratch = aligned_alloc(64, (bytes + 63) / 64 * 64);
  p->scratch_bytes = p->scratch ? bytes : 0;
  return p->scratch;
}

void sim_pool_free(sim_pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  atomic_store(&p->stop, 1);
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->th[i], NULL);
  free(p->th);
  pthread_cond_destroy(&p->go);
  pthread_cond_destroy(&p->done);
  pthread_mutex_destroy(&p->mu);
  free(p->scratch);
  free(p);
}
