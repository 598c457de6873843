/* The worker pool (pool.c): every task of a region runs exactly once, on any number of threads, and
 * sim_pool_run_ahead's next[worker] names, while a task runs, the task that worker runs next (-1 when
 * it runs none, or when that is one of the region's last tasks, claimed by whichever worker is free).
 * Built under ASan/UBSan and under TSan (make asan-test, make tsan-test). */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "internal.h"

#define MAX_TASKS 200

typedef struct region {
  const int *next;                 /* the pool's next[] (run_ahead), else NULL */
  atomic_int runs[MAX_TASKS];      /* times each task ran */
  int worker_of[MAX_TASKS];        /* written by the task's own run only */
  int next_of[MAX_TASKS];          /* next[worker] as the task saw it */
  atomic_int order;                /* a global sequence number per run */
  int seq_of[MAX_TASKS];
} region;

static void task(void *ctx, int t, int worker) {
  region *r = ctx;
  CHECK(t >= 0 && t < MAX_TASKS && worker >= 0 && worker < SIM_POOL_MAX);
  atomic_fetch_add(&r->runs[t], 1);
  r->worker_of[t] = worker;
  r->next_of[t] = r->next ? r->next[worker] : -2;
  r->seq_of[t] = atomic_fetch_add(&r->order, 1);
  for (volatile int i = 0; i < (t % 7) * 200; i++) {
  } /* uneven tasks */
}

static region r;

/* A region of n tasks: each runs once, on a worker below `workers`, with run_ahead's next[] rule. */
static void check_region_on(sim_pool *pool, int n, int ahead, int workers) {
  const int threads = sim_pool_threads(pool);
  memset(&r, 0, sizeof r);
  int next[SIM_POOL_MAX];
  for (int i = 0; i < SIM_POOL_MAX; i++) next[i] = -7;
  r.next = ahead ? next : NULL;
  if (ahead) sim_pool_run_ahead(pool, task, &r, n, next);
  else sim_pool_run(pool, task, &r, n);
  for (int t = 0; t < n; t++) CHECK(atomic_load(&r.runs[t]) == 1 && r.worker_of[t] < workers);
  for (int t = n; t < MAX_TASKS; t++) CHECK(atomic_load(&r.runs[t]) == 0);
  if (!ahead) {
    for (int t = 0; t < n; t++) CHECK(r.next_of[t] == -2);
    return;
  }
  /* per worker, its tasks in the order it ran them: each one's next is the one after it, or -1 when
   * that one is among the region's last `threads` tasks (claimed when the worker was free) */
  int named = 0;
  for (int w = 0; w < SIM_POOL_MAX; w++) {
    int last = -1;
    for (;;) {
      int best = -1; /* the first task of w run after `last` */
      for (int t = 0; t < n; t++)
        if (r.worker_of[t] == w && (last < 0 || r.seq_of[t] > r.seq_of[last]) &&
            (best < 0 || r.seq_of[t] < r.seq_of[best]))
          best = t;
      if (last >= 0) {
        CHECK(r.next_of[last] == best || (r.next_of[last] == -1 && best >= n - threads));
        named += r.next_of[last] >= 0;
      }
      if (best < 0) break;
      last = best;
    }
  }
  CHECK(named >= n - 2 * threads); /* all but the tail's were named ahead */
}

static void check_region(sim_pool *pool, int n, int ahead) {
  check_region_on(pool, n, ahead, sim_pool_threads(pool));
}

/* sim_pool_share: while c engines compute, a region runs on threads / c of the pool's threads (the
 * owner alone when that is one), and every task still runs exactly once. */
static atomic_int computing;
static atomic_int toggling;

static void *toggle(void *arg) {
  (void)arg;
  for (int i = 0; atomic_load(&toggling); i++) atomic_store(&computing, 1 + (i & 1));
  return NULL;
}

static void test_shared_pools(void) {
  const int sizes[] = {1, 5, 16, 199};
  sim_pool *p2 = sim_pool_new(2), *p4 = sim_pool_new(4);
  sim_pool_share(p2, &computing);
  sim_pool_share(p4, &computing);
  const struct {
    int c, workers2, workers4;
  } cases[] = {{0, 2, 4}, {1, 2, 4}, {2, 1, 2}, {3, 1, 1}, {8, 1, 1}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    atomic_store(&computing, cases[k].c);
    for (int rep = 0; rep < 100; rep++)
      for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
        for (int ahead = 0; ahead < 2; ahead++) {
          check_region_on(p2, sizes[s], ahead, sim_pool_threads(p2) < 2 ? 1 : cases[k].workers2);
          check_region_on(p4, sizes[s], ahead, sim_pool_threads(p4) < 4 ? 4 : cases[k].workers4);
        }
  }
  /* the count changing while regions start and helpers wake (TSan: no race on the region's state) */
  atomic_store(&toggling, 1);
  pthread_t th;
  CHECK(pthread_create(&th, NULL, toggle, NULL) == 0);
  for (int rep = 0; rep < 300; rep++)
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
      check_region_on(p2, sizes[s], rep & 1, 2);
      check_region_on(p4, sizes[s], rep & 1, 4);
    }
  atomic_store(&toggling, 0);
  pthread_join(th, NULL);
  sim_pool_free(p2);
  sim_pool_free(p4);
}

int main(void) {
  const int sizes[] = {1, 2, 3, 5, 16, 48, 199};
  sim_pool *pools[] = {NULL, sim_pool_new(1), sim_pool_new(2), sim_pool_new(3)};
  for (size_t p = 0; p < sizeof pools / sizeof pools[0]; p++)
    for (int rep = 0; rep < 200; rep++)
      for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
        check_region(pools[p], sizes[s], 1);
        check_region(pools[p], sizes[s], 0);
      }
  for (size_t p = 0; p < sizeof pools / sizeof pools[0]; p++) sim_pool_free(pools[p]);
  test_shared_pools();
  printf("test_pool: ok\n");
  return 0;
}
