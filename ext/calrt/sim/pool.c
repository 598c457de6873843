/* pool.c — the worker threads an engine uses inside one job (the kernels split output rows over them).
 *
 * An engine's worker thread owns its pool: it creates it on the first job that computes, runs every
 * parallel region itself (it takes tasks too, as worker 0) and destroys it when it exits. A region is
 * a set of independent tasks claimed with an atomic counter tagged with the region's number;
 * sim_pool_run returns once every task has finished (an atomic count each task bumps after its
 * writes), so the caller sees every task's writes. It never waits for a helper that has not started
 * a task: on a loaded host a helper may wake late, and then simply finds nothing left to do.
 * Which thread runs a task never changes what it computes: each task writes its own outputs with its
 * own fixed order of operations.
 *
 * Size: CALRT_SIM_THREADS (1 = no helpers, the old single-threaded kernels), else the CPUs online,
 * at most SIM_POOL_MAX.
 */
#include <stdlib.h>
#include <unistd.h>

#include "internal.h"

#define SIM_POOL_MAX 16

struct sim_pool {
  int n_threads; /* including the owner */
  pthread_t *th;
  pthread_mutex_t mu;
  pthread_cond_t go, done;
  uint64_t gen;   /* region number (mu) */
  int stop;       /* (mu) */
  sim_task_fn fn; /* current region (mu) */
  void *ctx;
  int n_tasks;
  /* (region number << 32) | next task: a claim succeeds only for the region it was read for, so a
   * helper that wakes late can never run a task of a newer region with an older region's fn/ctx. */
  atomic_ullong claim;
  atomic_int finished; /* tasks of the current region that have returned */
};

typedef struct helper_arg {
  sim_pool *pool;
  int worker;
} helper_arg;

/* Run tasks of region `gen` until none is left. Returns how many this thread ran. */
static void claim_tasks(sim_pool *p, uint64_t gen, sim_task_fn fn, void *ctx, int n_tasks, int worker) {
  unsigned long long c = atomic_load(&p->claim);
  for (;;) {
    if ((c >> 32) != (gen & 0xFFFFFFFFu) || (int)(c & 0xFFFFFFFFu) >= n_tasks) return;
    if (!atomic_compare_exchange_weak(&p->claim, &c, c + 1)) continue; /* c reloaded */
    fn(ctx, (int)(c & 0xFFFFFFFFu), worker);
    if (atomic_fetch_add(&p->finished, 1) + 1 == n_tasks) { /* the region's last task */
      pthread_mutex_lock(&p->mu);
      pthread_cond_signal(&p->done);
      pthread_mutex_unlock(&p->mu);
    }
    c = atomic_load(&p->claim);
  }
}

static void *helper(void *arg) {
  helper_arg a = *(helper_arg *)arg;
  free(arg);
  sim_pool *p = a.pool;
  uint64_t seen = 0;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (p->gen == seen && !p->stop) pthread_cond_wait(&p->go, &p->mu);
    if (p->stop) break;
    seen = p->gen;
    sim_task_fn fn = p->fn;
    void *ctx = p->ctx;
    int n = p->n_tasks;
    pthread_mutex_unlock(&p->mu);
    claim_tasks(p, seen, fn, ctx, n, a.worker); /* nothing left if it woke after the others ran all */
    pthread_mutex_lock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

int sim_pool_default_threads(void) {
  const char *env = getenv("CALRT_SIM_THREADS");
  long n = 0;
  if (env && *env) n = strtol(env, NULL, 10);
  if (n < 1) n = sysconf(_SC_NPROCESSORS_ONLN);
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
  atomic_init(&p->claim, 0);
  atomic_init(&p->finished, 0);
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

/* The owner never waits for a helper to wake up: it runs every task nobody else claimed, and waits
 * only for tasks a helper has started (whose outputs it is about to read). */
void sim_pool_run(sim_pool *p, sim_task_fn fn, void *ctx, int n_tasks) {
  if (n_tasks <= 0) return;
  if (!p || p->n_threads == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
    return;
  }
  pthread_mutex_lock(&p->mu);
  uint64_t gen = ++p->gen;
  p->fn = fn;
  p->ctx = ctx;
  p->n_tasks = n_tasks;
  atomic_store(&p->finished, 0);
  atomic_store(&p->claim, (unsigned long long)(gen & 0xFFFFFFFFu) << 32);
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  claim_tasks(p, gen, fn, ctx, n_tasks, 0);
  if (atomic_load(&p->finished) < n_tasks) {
    pthread_mutex_lock(&p->mu);
    while (atomic_load(&p->finished) < n_tasks) pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
  }
}

void sim_pool_free(sim_pool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n_threads - 1; i++) pthread_join(p->th[i], NULL);
  free(p->th);
  pthread_cond_destroy(&p->go);
  pthread_cond_destroy(&p->done);
  pthread_mutex_destroy(&p->mu);
  free(p);
}
