/* pool.c — the worker threads an engine uses inside one job (the kernels split output rows over them).
 *
 * An engine's worker thread owns its pool: it creates it on the first job that computes, runs every
 * parallel region itself (it takes tasks too, as worker 0) and destroys it when it exits. A region is
 * a set of independent tasks claimed with an atomic counter; sim_pool_run returns once every task has
 * finished, so the caller sees every task's writes (the helpers' last step is under the pool mutex).
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
  uint64_t gen;     /* region number (mu) */
  int busy_helpers; /* helpers still in the current region (mu) */
  int stop;         /* (mu) */
  sim_task_fn fn;   /* current region (mu) */
  void *ctx;
  int n_tasks;
  atomic_int next; /* next task to claim */
};

typedef struct helper_arg {
  sim_pool *pool;
  int worker;
} helper_arg;

static void claim_tasks(sim_pool *p, sim_task_fn fn, void *ctx, int n_tasks, int worker) {
  for (;;) {
    int t = atomic_fetch_add(&p->next, 1);
    if (t >= n_tasks) return;
    fn(ctx, t, worker);
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
    claim_tasks(p, fn, ctx, n, a.worker);
    pthread_mutex_lock(&p->mu);
    if (--p->busy_helpers == 0) pthread_cond_signal(&p->done);
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
  atomic_init(&p->next, 0);
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

void sim_pool_run(sim_pool *p, sim_task_fn fn, void *ctx, int n_tasks) {
  if (n_tasks <= 0) return;
  if (!p || p->n_threads == 1 || n_tasks == 1) {
    for (int t = 0; t < n_tasks; t++) fn(ctx, t, 0);
    return;
  }
  pthread_mutex_lock(&p->mu);
  p->fn = fn;
  p->ctx = ctx;
  p->n_tasks = n_tasks;
  atomic_store(&p->next, 0);
  p->busy_helpers = p->n_threads - 1;
  p->gen++;
  pthread_cond_broadcast(&p->go);
  pthread_mutex_unlock(&p->mu);
  claim_tasks(p, fn, ctx, n_tasks, 0);
  pthread_mutex_lock(&p->mu);
  while (p->busy_helpers > 0) pthread_cond_wait(&p->done, &p->mu);
  pthread_mutex_unlock(&p->mu);
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
