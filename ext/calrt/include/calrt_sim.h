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

#ifdef __cplusplus
}
#endif
#endif
