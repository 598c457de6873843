/* profile.c — where a decode step's wall time goes, per phase of the forward pass (a debugging aid).
 *
 * CALRT_SIM_PROFILE=1: sim_forward adds each decode job's time per phase (the engine thread's wall
 * clock around each stretch: a parallel region counts its slowest worker and its barrier) to counters
 * per row count, and the process prints one line per row count seen to stderr when it exits, e.g.
 *   calrt-sim profile R=16: 97 steps, 49.80 ms/step: norms 0.9% qkv 12.1% rope+kv 1.5% attn 12.6% ...
 * followed by the share of the step the engine thread spent waiting at the end of its parallel
 * regions for tasks a helper was still running (imbalance, a preempted helper) and the pool regions
 * per step.
 * Off (the default), a phase mark is one predictable branch. Prefill jobs are not counted.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define PROF_ROWS 64 /* row counts >= this share the last slot */

static const char *const phase_names[SIM_PROF_PHASES] = {"norms", "qkv", "rope+kv", "attn", "o", "gate/up",
                                                         "down", "lm_head"};
static atomic_llong prof_ns[PROF_ROWS][SIM_PROF_PHASES];
static atomic_llong prof_steps[PROF_ROWS];
static atomic_llong prof_wait_ns[PROF_ROWS], prof_regions[PROF_ROWS];
static atomic_int prof_state = -1; /* -1 unknown, 0 off, 1 on */

static void prof_report(void) {
  for (int r = 0; r < PROF_ROWS; r++) {
    const long long n = atomic_load(&prof_steps[r]);
    if (n == 0) continue;
    long long tot = 0;
    for (int p = 0; p < SIM_PROF_PHASES; p++) tot += atomic_load(&prof_ns[r][p]);
    char line[512];
    int len = snprintf(line, sizeof line, "calrt-sim profile R=%d%s: %lld steps, %.2f ms/step:", r,
                       r == PROF_ROWS - 1 ? "+" : "", n, (double)tot / (double)n / 1e6);
    for (int p = 0; p < SIM_PROF_PHASES && len > 0 && (size_t)len < sizeof line; p++)
      len += snprintf(line + len, sizeof line - (size_t)len, " %s %.1f%%", phase_names[p],
                      tot > 0 ? 100.0 * (double)atomic_load(&prof_ns[r][p]) / (double)tot : 0.0);
    if (len > 0 && (size_t)len < sizeof line)
      snprintf(line + len, sizeof line - (size_t)len, "; owner waiting for helpers %.1f%%, %.0f pool regions/step",
               tot > 0 ? 100.0 * (double)atomic_load(&prof_wait_ns[r]) / (double)tot : 0.0,
               (double)atomic_load(&prof_regions[r]) / (double)n);
    fprintf(stderr, "%s\n", line);
  }
}

int sim_prof_enabled(void) {
  int s = atomic_load_explicit(&prof_state, memory_order_relaxed);
  if (s >= 0) return s;
  const char *env = getenv("CALRT_SIM_PROFILE");
  s = env && *env && strcmp(env, "0") != 0;
  int expected = -1;
  if (atomic_compare_exchange_strong(&prof_state, &expected, s) && s) atexit(prof_report);
  return atomic_load(&prof_state);
}

void sim_prof_add(int rows, const double *phase_us, double wait_us, long long regions) {
  const int r = rows < PROF_ROWS ? (rows > 0 ? rows : 0) : PROF_ROWS - 1;
  for (int p = 0; p < SIM_PROF_PHASES; p++) atomic_fetch_add(&prof_ns[r][p], (long long)(phase_us[p] * 1e3));
  atomic_fetch_add(&prof_wait_ns[r], (long long)(wait_us * 1e3));
  atomic_fetch_add(&prof_regions[r], regions);
  atomic_fetch_add(&prof_steps[r], 1);
}
