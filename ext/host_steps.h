/* host_steps.h — multi-step greedy decode driven by the host, over calrt.h's core API only.
 *
 * A device with the multi_step capability (C3-style, sim-next) runs N greedy steps in one job and
 * feeds each lane's argmax back itself. This does the same on any runtime (calrt-0.7.6 included):
 * N one-step decode jobs back to back on one engine, each lane's argmax (the first index of the
 * largest value, a NaN counting as the largest: numpy's argmax) fed back by this code in C, on the
 * thread that waits, with no Python between the steps. The host's per-job work in Python (pick,
 * submit, wait, verify, commit, hand each token on) is then paid once per N tokens of every lane,
 * as with the device's multi-step, while the device still runs one step a job.
 *
 * Its outputs are the device multi-step's (calrt_job_create_decode_steps in calrt.h): each lane's
 * logits row, echo and checksum are its last step's, with the echo naming the run's id (its first
 * job's); the step tokens are [lanes, steps] int32, zeros after a lane's steps and for invalid
 * lanes. Every step's output is checked before its tokens are fed back: each valid lane must echo
 * (that step's job id, its sequence, its position) and its row must hash to its checksum. A step
 * that fails that check, or completes other than OK, or cannot be submitted, ends the run there:
 *   - not OK: the run's status is that step's (a submit refused after a reset: ABORTED), every
 *     step token is zero, and the lanes of that step report its outputs as they are;
 *   - a failed check: the run completes OK, and the lanes of that step report its outputs as they
 *     are (another job's id in the echo, a position short of the last step's, or the bad row), so
 *     the host's own check of the run's outputs finds them, as it would a crosstalk of any job.
 * Unlike the device's multi-step, the steps before a failure have committed their KV; a failed
 * job leaves its sequences unknown either way, and the host recovers them (reset, re-prefill).
 *
 * Threads: one thread drives a run at a time (hs_wait blocks; hs_poll only advances when no other
 * thread holds the run, and never blocks). hs_free may be called at any time by the owner once no
 * call is in progress: a step still in flight is released (the engine keeps its own reference) and
 * no further step is submitted.
 */
#ifndef CALSERVE_HOST_STEPS_H
#define CALSERVE_HOST_STEPS_H

#include <stdint.h>

#include "calrt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct hs_run hs_run;

/* Create the run and submit its first step on `engine`. Arguments as calrt_job_create_decode_steps
 * (steps in [1, CALRT_MAX_DECODE_STEPS], each valid lane's lane_steps[l] in [1, steps]; NULL: every
 * lane `steps`). Errors: those of calrt_job_create_decode / calrt_job_submit, INVALID_ARGUMENT for
 * the step counts, HOST_OOM. */
calrt_status hs_start(calrt_calbin *cb, calrt_engine engine, const int32_t *seq_ids, const int32_t *tokens,
                      const int32_t *positions, const uint8_t *valid, int32_t lanes, int32_t steps,
                      const int32_t *lane_steps, hs_run **out);
/* hs_start, and each valid lane l ends early on one of its end tokens: end_ids[end_off[l] ..
 * end_off[l + 1]) (end_off: lanes + 1 offsets from 0, non-decreasing; NULL: no lane has any), once its
 * step k >= end_from[l] (NULL: from its first step). A lane whose step's argmax is one of them ends
 * with that step, as if its lane_steps had been k + 1: it is not submitted again, its outputs are
 * that step's. The run ends when no lane runs any more (hs_steps_run then counts the steps it ran).
 * The engine's use: a request ends on its EOS or a stop token, and its client is waiting for its
 * last event; without this the run's other steps run for nothing (host_steps.c). */
calrt_status hs_start_ends(calrt_calbin *cb, calrt_engine engine, const int32_t *seq_ids, const int32_t *tokens,
                           const int32_t *positions, const uint8_t *valid, int32_t lanes, int32_t steps,
                           const int32_t *lane_steps, const int32_t *end_off, const int32_t *end_ids,
                           const int32_t *end_from, hs_run **out);
/* Drive the run until it finished (CALRT_OK, *status its status) or timeout_us passed (< 0: no
 * limit; CALRT_E_TIMEOUT: a step is still in flight, call again). */
calrt_status hs_wait(hs_run *r, int64_t timeout_us, calrt_job_status *status);
/* Advance the run as far as it goes without blocking; 1 once it finished. */
int hs_poll(hs_run *r);
/* The run's outputs (valid until hs_free; CALRT_E_INVALID_ARGUMENT before it finished). */
calrt_status hs_result(hs_run *r, calrt_job_result *out, const int32_t **step_tokens);
int64_t hs_id(const hs_run *r);
int32_t hs_steps(const hs_run *r);
/* Steps the run submitted so far (for tests and statistics). */
int32_t hs_submitted(const hs_run *r);
/* Ask the run to end early (any thread, any time, never blocks): once the step in flight completes
 * and checks out, every lane still running ends with it, as if its lane_steps had been the steps run
 * so far. A stop that comes after the last step was submitted changes nothing; a failing step ends
 * the run as always. The engine's use: a prompt waits for its prefill, or a sequence of the batch
 * was cancelled, while the run still had steps to go. */
void hs_stop(hs_run *r);
/* Once finished, the steps the run's lanes ran at most: hs_steps, or fewer after hs_stop or when every
 * lane ended on an end token before. The step tokens are then [lanes, hs_steps_run], zeros after a
 * lane's own steps (hs_lane_steps). Before it finished: hs_steps. */
int32_t hs_steps_run(const hs_run *r);
/* Once finished, each lane's steps run ([lanes]; 0 for a lane not valid at the start): its lane_steps,
 * or fewer when it ended on an end token or the run was stopped. NULL before it finished. */
const int32_t *hs_lane_steps(const hs_run *r);
/* Once finished: 1 when a valid lane ran fewer steps than its lane_steps (an end token, hs_stop). */
int hs_short(const hs_run *r);
void hs_free(hs_run *r);

#ifdef __cplusplus
}
#endif
#endif /* CALSERVE_HOST_STEPS_H */
