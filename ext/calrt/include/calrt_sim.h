/*
 * calrt_sim.h — debug entry points of the software runtime only (never part of a vendor build).
 * The binding resolves them with dlsym() at run time; when absent it reports NotSupported.
 */
#ifndef CALRT_SIM_H
#define CALRT_SIM_H
#include "calrt.h"
#ifdef __cplusplus
extern "C" {
#endif

typedef enum calrt_sim_fault {
  CALRT_SIM_FAULT_TIMEOUT = 0,     /* the job never completes until a reset (then ABORTED) */
  CALRT_SIM_FAULT_CCU = 1,         /* job completes CCU_FAULT, chip faulted, job KV unknown */
  CALRT_SIM_FAULT_DMA_UNKNOWN = 2, /* job completes DMA_UNKNOWN, chip faulted, reconfigure needed */
  CALRT_SIM_FAULT_BUSY = 3,        /* that submit is refused with CALRT_E_BUSY */
  CALRT_SIM_FAULT_CROSSTALK = 4    /* `lane`'s logits corrupted after its checksum was taken */
} calrt_sim_fault;

/* Arm a fault for the nth (1-based) submit attempt from now on (chip, engine). */
calrt_status calrt_sim_inject_fault(calrt_device *dev, int chip, calrt_engine engine,
                                    calrt_sim_fault kind, int32_t nth, int32_t lane);
/* Seeded random completion delay in [0, jitter_us] per job; null_compute: pseudo-logits, no model.
 * Call before creating calbins. */
calrt_status calrt_sim_configure(calrt_device *dev, int null_compute, int64_t jitter_us, uint64_t seed);
/* Copy the raw KV storage of a sequence (layout calrt_calbin_info.kv_shape, fp32 or bf16 bits).
 * *n in: buffer size; out: bytes needed/written. */
calrt_status calrt_sim_read_kv(calrt_calbin *cb, int32_t seq_id, void *buf, size_t *n);

/* Completion notification fd of one job engine (optional extension; the binding looks it up with
 * dlsym, so a vendor libcalrt without it still links and the caller falls back to a thread blocked in
 * calrt_job_wait). *fd: a non-blocking, close-on-exec Linux eventfd (counter mode, not semaphore)
 * that the engine's worker increments by 1 after every job of (chip, engine) completes — OK, failed,
 * INVALID or ABORTED (a reset) alike — and only after calrt_job_done() reports it, so the protocol
 *   drain (read, EAGAIN ignored) -> check calrt_job_done() -> if not done, poll/epoll for readable
 * never loses a wake-up (a count may be stale: one spurious wake-up, never a missed one).
 * Created on the first call (the same fd on every later call), owned by the runtime: the caller only
 * reads it and must not close it; it is closed by calrt_device_close (stop waiting on it first).
 * Errors: CLOSED, INVALID_ARGUMENT (chip/engine/fd), INTERNAL (eventfd() failed).
 * Vendor question (spec §20): can a completion interrupt/doorbell be exposed as a pollable fd per job
 * engine (or per chip), with this ordering guarantee against calrt_job_done? */
calrt_status calrt_sim_engine_completion_fd(calrt_device *dev, int chip, calrt_engine engine, int *fd);

#ifdef __cplusplus
}
#endif
#endif
