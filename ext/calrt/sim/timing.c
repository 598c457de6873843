/* timing.c — monotonic clock helpers and the modeled device time of a job. */
#include <math.h>
#include <time.h>

#include "internal.h"

double sim_now_us(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

void sim_deadline_ts(double at_us, struct timespec *ts) {
  if (at_us < 0) at_us = 0;
  double sec = floor(at_us / 1e6);
  ts->tv_sec = (time_t)sec;
  ts->tv_nsec = (long)((at_us - sec * 1e6) * 1e3);
  if (ts->tv_nsec >= 1000000000L) {
    ts->tv_sec += 1;
    ts->tv_nsec -= 1000000000L;
  }
}

/* Condition variables wait on CLOCK_MONOTONIC so wall-clock changes never stretch a timeout. */
void sim_cond_init(pthread_cond_t *c) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  pthread_cond_init(c, &a);
  pthread_condattr_destroy(&a);
}

/* splitmix64 */
uint64_t sim_rng_next(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/* Modeled device time of a job: prefill_base + n * per_token, or the decode step of this calbin's B. */
double sim_modeled_us(const calrt_calbin *cb, const calrt_job *job) {
  if (job->kind == JOB_PREFILL)
    return cb->t.prefill_base_us + (double)job->n_tok * cb->t.prefill_us_per_token;
  return cb->t.decode_step_us * (double)job->steps;
}
