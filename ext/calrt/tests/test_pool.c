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

static void check_region(sim_pool *pool, int n, int ahead) {
  const int threads = sim_pool_threads(pool);
  static region r;
  memset(&r, 0, sizeof r);
  int next[SIM_POOL_MAX];
  for (int i = 0; i < SIM_POOL_MAX; i++) next[i] = -7;
  r.next = ahead ? next : NULL;
  if (ahead) sim_pool_run_ahead(pool, task, &r, n, next);
  else sim_pool_run(pool, task, &r, n);
  for (int t = 0; t < n; t++) CHECK(atomic_load(&r.runs[t]) == 1);
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
  printf("test_pool: ok\n");
  return 0;
}
