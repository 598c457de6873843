/* The engine worker's adaptive poll for its next job (engine.c, wait_for_job): the cap from
 * CALRT_SIM_ENGINE_SPIN_US, and the window's growth and decay (sim_engine_poll_missed). The worker's
 * use of it under concurrent submits is exercised by test_calrt.c (ASan) and stress_calrt.c (TSan),
 * both with the default poll on. */
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>

#include "check.h"
#include "internal.h"

static sim_engine_poll with_env(const char *v) {
  if (v) setenv("CALRT_SIM_ENGINE_SPIN_US", v, 1);
  else unsetenv("CALRT_SIM_ENGINE_SPIN_US");
  return sim_engine_poll_new();
}

static int in_range(const sim_engine_poll *p) {
  return p->window == 0.0 || (p->window >= SIM_ENGINE_SPIN_MIN_US && p->window <= p->cap);
}

int main(void) {
  /* the cap: the default (none on one CPU), a valid override, or the default for anything
   * unparsable */
  const double dflt = sim_usable_cpus() >= 2 ? SIM_ENGINE_SPIN_CAP_US : 0.0;
  sim_engine_poll p = with_env(NULL);
  CHECK(p.cap == dflt && p.window == p.cap);
#if defined(__linux__)
  {
    cpu_set_t all, one;
    CHECK(sched_getaffinity(0, sizeof all, &all) == 0);
    CPU_ZERO(&one);
    for (int c = 0; c < CPU_SETSIZE; c++)
      if (CPU_ISSET(c, &all)) {
        CPU_SET(c, &one);
        break;
      }
    CHECK(sched_setaffinity(0, sizeof one, &one) == 0);
    CHECK(with_env(NULL).cap == 0.0);  /* pinned to one CPU: never polls by default */
    CHECK(with_env("50").cap == 50.0); /* unless told to */
    CHECK(sched_setaffinity(0, sizeof all, &all) == 0);
  }
#endif
  p = with_env("50");
  CHECK(p.cap == 50.0 && p.window == 50.0);
  const char *bad[] = {"", "abc", "-5", "12x", "1e9"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    p = with_env(bad[i]);
    CHECK(p.cap == dflt);
  }
  /* 0: never polls, whatever the arrivals */
  p = with_env("0");
  CHECK(p.cap == 0.0 && p.window == 0.0);
  const double idles[] = {0.0, 5.0, 500.0, 1e6};
  for (size_t i = 0; i < sizeof idles / sizeof idles[0]; i++) {
    sim_engine_poll_missed(&p, idles[i]);
    CHECK(p.window == 0.0);
  }
  /* late jobs halve the window down to none; quick ones grow it back to the cap */
  p = with_env("200");
  const double cap = p.cap;
  int halvings = 0;
  while (p.window > 0.0) {
    const double before = p.window;
    sim_engine_poll_missed(&p, cap + 1.0);
    CHECK(p.window == 0.0 || p.window == before / 2.0);
    CHECK(in_range(&p));
    halvings++;
    CHECK(halvings < 20);
  }
  CHECK(halvings >= 2); /* an idle engine polls a few more times, then never */
  sim_engine_poll_missed(&p, cap + 1.0);
  CHECK(p.window == 0.0);
  sim_engine_poll_missed(&p, cap); /* within the cap: a poll would have caught it */
  CHECK(p.window == SIM_ENGINE_SPIN_MIN_US);
  int doublings = 0;
  while (p.window < cap) {
    const double before = p.window;
    sim_engine_poll_missed(&p, cap / 2.0);
    CHECK(p.window == (before * 2.0 < cap ? before * 2.0 : cap));
    CHECK(in_range(&p));
    doublings++;
    CHECK(doublings < 20);
  }
  /* any sequence of arrivals keeps the window in {0} or [min, cap] */
  unsigned long long x = 88172645463325252ULL;
  for (int i = 0; i < 100000; i++) {
    x ^= x << 13; x ^= x >> 7; x ^= x << 17;
    sim_engine_poll_missed(&p, (double)(x % 1000));
    CHECK(in_range(&p));
  }
  printf("engine poll: OK\n");
  return 0;
}
