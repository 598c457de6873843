/* device.c — the process's one VirtualDevice: open/close, chips, DRAM, reset, counters, errors. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static _Thread_local char g_last_error[256];
static pthread_mutex_t g_open_mu = PTHREAD_MUTEX_INITIALIZER;
/* Invariant: at most one open device per process; its storage is static so that late waiters and
 * counters never touch freed memory even around close(). */
static struct calrt_device g_dev;

const char *calrt_last_error(void) { return g_last_error; }

calrt_status sim_err(calrt_status st, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
  va_end(ap);
  return st;
}

/* 4-way interleaved FNV-1a 64 over little-endian 64-bit words (see calrt.h): four independent multiply
 * chains instead of one per byte, so a 600 KB logits row (151,936 floats) hashes in tens of microseconds
 * instead of ~0.7 ms. */
static const uint64_t FNV_OFFSET = 1469598103934665603ULL, FNV_PRIME = 1099511628211ULL;

uint64_t calrt_checksum(const void *data, size_t n) {
  const unsigned char *p = (const unsigned char *)data;
  uint64_t h[4] = {FNV_OFFSET, FNV_OFFSET ^ 1, FNV_OFFSET ^ 2, FNV_OFFSET ^ 3};
  size_t words = n / 8, i = 0;
  for (; i + 4 <= words; i += 4) {
    for (int k = 0; k < 4; k++) {
      uint64_t w;
      memcpy(&w, p + 8 * (i + (size_t)k), 8);
      h[k] = (h[k] ^ w) * FNV_PRIME;
    }
  }
  for (; i < words; i++) {
    uint64_t w;
    memcpy(&w, p + 8 * i, 8);
    h[i & 3] = (h[i & 3] ^ w) * FNV_PRIME;
  }
  uint64_t tail = 0;
  for (size_t b = 8 * words; b < n; b++) tail |= (uint64_t)p[b] << (8 * (b - 8 * words));
  uint64_t out = FNV_OFFSET;
  for (int k = 0; k < 4; k++) out = (out ^ h[k]) * FNV_PRIME;
  out = (out ^ tail) * FNV_PRIME;
  return (out ^ (uint64_t)n) * FNV_PRIME;
}

static calrt_status check_dev(calrt_device *dev) {
  if (!dev || dev != &g_dev || !dev->open) return sim_err(CALRT_E_CLOSED, "device is not open");
  return CALRT_OK;
}

static calrt_status check_chip(calrt_device *dev, int chip) {
  calrt_status st = check_dev(dev);
  if (st) return st;
  if (chip < 0 || chip >= dev->info.chips)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "chip: %d is not in [0, %d)", chip, dev->info.chips);
  return CALRT_OK;
}

/* calrt-sim's boards: each index is an independent simulated board. Its state (DRAM, queues, fault
 * and reset domain) is this process's device, so boards are isolated by being opened in separate
 * processes (one process per board); the index also seeds the chips' random streams (completion
 * jitter), so two boards given the same runtime seed do not move in lockstep. Board 0 keeps the
 * streams it always had. The simulator does not model one board being owned by another process. */
#define SIM_BOARDS 16
static const uint64_t BOARD_MIX = 0xA24BAED4963EE407ULL;

calrt_status calrt_device_count(int *out) {
  if (!out) return sim_err(CALRT_E_INVALID_ARGUMENT, "out must not be NULL");
  *out = SIM_BOARDS;
  return CALRT_OK;
}

calrt_status calrt_device_open(const calrt_open_params *params, calrt_device **out) {
  if (!params || !out || !params->profile)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "params/out must not be NULL");
  int next = 0;
  if (strcmp(params->profile, "calrt-0.7.6") == 0) next = 0;
  else if (strcmp(params->profile, "sim-next") == 0) next = 1;
  else return sim_err(CALRT_E_INVALID_ARGUMENT, "profile: unknown runtime profile '%s'", params->profile);
  if (params->dram_bytes == 0) return sim_err(CALRT_E_INVALID_ARGUMENT, "dram_bytes must be > 0");
  if (params->device < 0 || params->device >= SIM_BOARDS)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "device: board %d does not exist (this runtime has boards 0..%d)",
                   (int)params->device, SIM_BOARDS - 1);
  pthread_mutex_lock(&g_open_mu);
  if (g_dev.open) {
    pthread_mutex_unlock(&g_open_mu);
    return sim_err(CALRT_E_ALREADY_OPEN, "a VirtualDevice is already open in this process");
  }
  calrt_device *d = &g_dev;
  memset(d, 0, sizeof *d);
  snprintf(d->info.profile, sizeof d->info.profile, "%s", params->profile);
  snprintf(d->info.runtime, sizeof d->info.runtime, "calrt-sim 0.7.6-compat");
  d->info.chips = next ? 2 : 1;
  d->info.queue_depth = CALRT_QUEUE_DEPTH;
  d->info.batch_profiles = next;
  d->info.multi_calbin = next;
  d->info.chip_scoped = next;
  d->info.pingpong = 1;
  d->info.do_shift = 1;
  d->info.shared_kv = next;
  d->info.prompt_logits = next; /* C3-style: calrt_job_create_prefill_all */
  d->info.multi_step = next;    /* C3-style: calrt_job_create_decode_steps */
  d->info.device = params->device;
  snprintf(d->info.serial, sizeof d->info.serial, "calrt-sim-board-%d", (int)params->device);
  pthread_mutex_init(&d->mu, NULL);
  d->next_calbin_id = 1;
  atomic_init(&d->next_job_id, 1);
  atomic_init(&d->computing, 0);
  atomic_init(&d->next_kv_group_id, 1);
  for (int c = 0; c < d->info.chips; c++) {
    sim_chip *ch = &d->chips[c];
    ch->dev = d;
    ch->index = c;
    pthread_mutex_init(&ch->mu, NULL);
    sim_cond_init(&ch->changed);
    ch->dram_capacity = params->dram_bytes;
    ch->rng = (0x9E3779B97F4A7C15ULL * (uint64_t)(c + 1)) ^ ((uint64_t)params->device * BOARD_MIX);
    if (sim_engines_start(ch) != 0) {
      for (int k = 0; k < c; k++) sim_engines_stop(&d->chips[k]);
      pthread_mutex_unlock(&g_open_mu);
      return sim_err(CALRT_E_INTERNAL, "could not start engine threads");
    }
  }
  d->open = 1;
  *out = d;
  pthread_mutex_unlock(&g_open_mu);
  return CALRT_OK;
}

calrt_status calrt_device_close(calrt_device *dev) {
  pthread_mutex_lock(&g_open_mu);
  calrt_status st = check_dev(dev);
  if (st) {
    pthread_mutex_unlock(&g_open_mu);
    return st;
  }
  pthread_mutex_lock(&dev->mu);
  int alive = dev->calbins != NULL;
  pthread_mutex_unlock(&dev->mu);
  if (alive) {
    pthread_mutex_unlock(&g_open_mu);
    return sim_err(CALRT_E_IN_USE, "calbins still exist: destroy them before closing the device");
  }
  for (int c = 0; c < dev->info.chips; c++) sim_engines_stop(&dev->chips[c]);
  for (int c = 0; c < dev->info.chips; c++) {
    pthread_mutex_destroy(&dev->chips[c].mu);
    pthread_cond_destroy(&dev->chips[c].changed);
  }
  pthread_mutex_destroy(&dev->mu);
  dev->open = 0;
  pthread_mutex_unlock(&g_open_mu);
  return CALRT_OK;
}

calrt_status calrt_device_info_get(calrt_device *dev, calrt_device_info *out) {
  calrt_status st = check_dev(dev);
  if (st) return st;
  *out = dev->info;
  return CALRT_OK;
}

calrt_status calrt_device_dram(calrt_device *dev, int chip, uint64_t *capacity, uint64_t *used) {
  calrt_status st = check_chip(dev, chip);
  if (st) return st;
  sim_chip *ch = &dev->chips[chip];
  pthread_mutex_lock(&ch->mu);
  *capacity = ch->dram_capacity;
  *used = ch->dram_used;
  pthread_mutex_unlock(&ch->mu);
  return CALRT_OK;
}

static void reset_chip(calrt_device *dev, sim_chip *ch) {
  pthread_mutex_lock(&ch->mu);
  ch->resetting = 1;
  /* Abort everything queued or running; workers complete them ABORTED and drain their queues. */
  for (;;) {
    int pending = 0;
    for (int e = 0; e < 2; e++) {
      sim_engine *en = &ch->engines[e];
      for (int i = 0; i < en->n_queued; i++) atomic_store(&en->queue[i]->abort, 1);
      pending += en->n_queued;
      if (en->n_queued) pthread_cond_signal(&en->cond);
    }
    if (!pending) break;
    pthread_cond_broadcast(&ch->changed);
    pthread_cond_wait(&ch->changed, &ch->mu);
  }
  /* Invariant: no job of this chip is queued or running here, so KV can be invalidated safely. A KV
   * group shared by several calbins is reached through each of them: invalidation is idempotent. */
  pthread_mutex_lock(&dev->mu);
  for (calrt_calbin *cb = dev->calbins; cb; cb = cb->next) {
    if (cb->chip != ch) continue;
    sim_kv_invalidate_all(cb);
    if (ch->dma_unknown && cb->configured) cb->needs_reconfigure = 1;
  }
  pthread_mutex_unlock(&dev->mu);
  for (int e = 0; e < 2; e++) {
    for (int i = 0; i < SIM_MAX_FAULTS; i++) ch->engines[e].faults[i].armed = 0;
    ch->engines[e].free_at_us = 0; /* an aborted job's modeled end must not delay the next one */
  }
  ch->faulted = 0;
  ch->dma_unknown = 0;
  ch->shared_free_at_us = 0;
  ch->resetting = 0;
  pthread_mutex_unlock(&ch->mu);
}

calrt_status calrt_device_reset(calrt_device *dev, int chip) {
  calrt_status st = check_dev(dev);
  if (st) return st;
  if (chip == -1) {
    for (int c = 0; c < dev->info.chips; c++) reset_chip(dev, &dev->chips[c]);
    return CALRT_OK;
  }
  st = check_chip(dev, chip);
  if (st) return st;
  reset_chip(dev, &dev->chips[chip]);
  return CALRT_OK;
}

calrt_status calrt_device_state(calrt_device *dev, int chip, int *faulted, int *needs_reconfigure) {
  calrt_status st = check_chip(dev, chip);
  if (st) return st;
  sim_chip *ch = &dev->chips[chip];
  pthread_mutex_lock(&ch->mu);
  *faulted = ch->faulted;
  int nr = 0;
  pthread_mutex_lock(&dev->mu);
  for (calrt_calbin *cb = dev->calbins; cb; cb = cb->next)
    if (cb->chip == ch && cb->needs_reconfigure) nr = 1;
  pthread_mutex_unlock(&dev->mu);
  *needs_reconfigure = nr || ch->dma_unknown;
  pthread_mutex_unlock(&ch->mu);
  return CALRT_OK;
}

calrt_status calrt_engine_counters(calrt_device *dev, int chip, calrt_engine engine,
                                   calrt_counters *out) {
  calrt_status st = check_chip(dev, chip);
  if (st) return st;
  if (engine != CALRT_ENGINE_PING && engine != CALRT_ENGINE_PONG)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "engine: %d is not PING(0) or PONG(1)", (int)engine);
  sim_chip *ch = &dev->chips[chip];
  pthread_mutex_lock(&ch->mu);
  *out = ch->engines[engine].counters;
  out->inflight = (uint64_t)ch->engines[engine].n_queued;
  out->timeouts = atomic_load(&ch->engines[engine].timeouts);
  pthread_mutex_unlock(&ch->mu);
  return CALRT_OK;
}

/* ---- sim-only ---- */

calrt_status calrt_sim_configure(calrt_device *dev, int null_compute, int64_t jitter_us, uint64_t seed) {
  calrt_status st = check_dev(dev);
  if (st) return st;
  if (jitter_us < 0) return sim_err(CALRT_E_INVALID_ARGUMENT, "jitter_us must be >= 0");
  pthread_mutex_lock(&dev->mu);
  if (dev->calbins) {
    pthread_mutex_unlock(&dev->mu);
    return sim_err(CALRT_E_IN_USE, "configure the simulator before creating calbins");
  }
  dev->null_compute = null_compute != 0;
  dev->jitter_us = jitter_us;
  pthread_mutex_unlock(&dev->mu);
  for (int c = 0; c < dev->info.chips; c++) {
    pthread_mutex_lock(&dev->chips[c].mu);
    dev->chips[c].rng = (seed * 0x9E3779B97F4A7C15ULL + (uint64_t)c * 0xD1B54A32D192ED03ULL + 1) ^
                        ((uint64_t)dev->info.device * BOARD_MIX);
    pthread_mutex_unlock(&dev->chips[c].mu);
  }
  return CALRT_OK;
}

calrt_status calrt_sim_inject_fault(calrt_device *dev, int chip, calrt_engine engine,
                                    calrt_sim_fault kind, int32_t nth, int32_t lane) {
  calrt_status st = check_chip(dev, chip);
  if (st) return st;
  if (engine != CALRT_ENGINE_PING && engine != CALRT_ENGINE_PONG)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "engine: %d is not PING(0) or PONG(1)", (int)engine);
  if ((int)kind < 0 || (int)kind > CALRT_SIM_FAULT_CROSSTALK)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "kind: unknown fault kind %d", (int)kind);
  if (nth < 1) return sim_err(CALRT_E_INVALID_ARGUMENT, "nth must be >= 1");
  if (lane < 0) return sim_err(CALRT_E_INVALID_ARGUMENT, "lane must be >= 0");
  sim_chip *ch = &dev->chips[chip];
  pthread_mutex_lock(&ch->mu);
  sim_engine *e = &ch->engines[engine];
  for (int i = 0; i < SIM_MAX_FAULTS; i++) {
    if (!e->faults[i].armed) {
      e->faults[i] = (sim_fault){.armed = 1, .kind = kind, .countdown = nth, .lane = lane};
      pthread_mutex_unlock(&ch->mu);
      return CALRT_OK;
    }
  }
  pthread_mutex_unlock(&ch->mu);
  return sim_err(CALRT_E_INVALID_ARGUMENT, "too many armed faults (max %d)", SIM_MAX_FAULTS);
}

calrt_status calrt_sim_engine_completion_fd(calrt_device *dev, int chip, calrt_engine engine, int *fd) {
  calrt_status st = check_chip(dev, chip);
  if (st) return st;
  if (engine != CALRT_ENGINE_PING && engine != CALRT_ENGINE_PONG)
    return sim_err(CALRT_E_INVALID_ARGUMENT, "engine: %d is not PING(0) or PONG(1)", (int)engine);
  if (!fd) return sim_err(CALRT_E_INVALID_ARGUMENT, "fd is NULL");
  sim_chip *ch = &dev->chips[chip];
  pthread_mutex_lock(&ch->mu);
  int f = sim_engine_completion_fd(&ch->engines[engine]);
  pthread_mutex_unlock(&ch->mu);
  if (f < 0) return sim_err(CALRT_E_INTERNAL, "eventfd() failed for the completion fd");
  *fd = f;
  return CALRT_OK;
}
