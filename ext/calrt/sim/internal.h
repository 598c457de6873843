/* internal.h — calrt-sim's private structures, shared by its source files (split by concern:
 * device.c, calbin.c, kv.c, engine.c, kernels.c, faults.c, timing.c). */
#ifndef CALRT_SIM_INTERNAL_H
#define CALRT_SIM_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "calrt.h"
#include "calrt_sim.h"

#define SIM_MAX_FAULTS 32

/* Per-layer weight pointers into the caller's (not copied) buffers. */
typedef struct sim_layer {
  /* post_norm: the MLP's input norm (post_attention_layernorm; Gemma 3, 2: pre_feedforward_layernorm) */
  const float *in_norm, *q, *k, *v, *o, *q_norm, *k_norm, *post_norm, *gate, *up, *down;
  const float *q_bias, *k_bias, *v_bias; /* Qwen2 only (NULL otherwise) */
  /* Gemma 3 and 2 only (NULL otherwise): the attention output's norm (post_attention_layernorm) and the
   * MLP output's (post_feedforward_layernorm), each before its residual add */
  const float *attn_out_norm, *ffn_out_norm;
} sim_layer;

typedef struct sim_seq {
  int allocated;
  int valid; /* 0 after reset / CCU fault: KV unknown */
  int busy;  /* a running job is writing it */
  int users; /* queued + running jobs naming it */
  int32_t len;
  /* Invariant: no KV byte at a position >= hwm was written since the last free (jobs raise it before
   * they run), so a free scrubs positions [0, hwm) only. */
  int32_t hwm;
  void *kv; /* [layers][2][kv_heads][max_seq][head_dim] of float or uint16 */
} sim_seq;

typedef struct sim_fault {
  int armed;
  calrt_sim_fault kind;
  int32_t countdown;
  int32_t lane;
} sim_fault;

/* The KvManager + KV memory + weights charge of a KV group (C3 shared KV, sim-next). A standalone
 * calbin is a group of one. Guarded by the chip mutex (every member lives on the same chip).
 * Invariant: refs == number of calbins whose ->kv points here; the group (its sequences, KV bytes and
 * the shared DRAM charge) is freed exactly when refs drops to 0. */
typedef struct sim_kvgroup {
  int32_t id;             /* unique per device (kv_group_id) */
  int refs;
  int32_t max_sequences;
  uint64_t seq_bytes;     /* KV bytes per sequence */
  uint64_t shared_bytes;  /* weights + KV of max_sequences sequences: charged once on the chip */
  sim_seq *seqs;          /* [max_sequences] */
} sim_kvgroup;

struct calrt_job;

/* A spin-wait loop's pause (x86 PAUSE: yields the core's pipeline to its sibling and saves power). */
static inline void sim_cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

/* pool.c: worker threads inside one job (see pool.c). fn(ctx, task, worker): worker in [0, threads). */
typedef struct sim_pool sim_pool;
#define SIM_POOL_MAX 16 /* threads of a pool, at most */
typedef void (*sim_task_fn)(void *ctx, int task, int worker);
int sim_pool_default_threads(void); /* CALRT_SIM_THREADS, else the CPUs this thread may run on */
long sim_usable_cpus(void);         /* the CPUs this thread may run on (its affinity mask) */
sim_pool *sim_pool_new(int n_threads); /* NULL on host OOM (callers then run single-threaded) */
int sim_pool_threads(const sim_pool *p);
void sim_pool_run(sim_pool *p, sim_task_fn fn, void *ctx, int n_tasks);
/* sim_pool_run, each worker claiming one task ahead: while a task runs on `worker`, next[worker]
 * (an array of sim_pool_threads entries) is the task it runs next (the task may prefetch its data),
 * or -1: none, or one of the region's last sim_pool_threads tasks, claimed only when a worker is free. */
void sim_pool_run_ahead(sim_pool *p, sim_task_fn fn, void *ctx, int n_tasks, int *next);
void sim_pool_free(sim_pool *p);
/* The pool shares the host's CPUs with the other engines counted in *computing (NULL: not shared):
 * a region started while c > 1 of them compute runs on n_threads / c of its threads (one: the owner
 * alone, no helper woken). Which thread runs a task never changes its result. */
void sim_pool_share(sim_pool *p, const atomic_int *computing);
/* The owner's grow-only scratch buffer (64-byte aligned, kept until sim_pool_free); NULL on OOM. */
void *sim_pool_scratch(sim_pool *p, size_t bytes);
/* CALRT_SIM_PROFILE only (else zeros): the owner's time spent waiting for helpers' tasks at the end
 * of its regions (microseconds) and the regions run on the pool, both since the pool was created. */
double sim_pool_wait_us(const sim_pool *p);
long long sim_pool_regions(const sim_pool *p);

typedef struct sim_engine {
  struct sim_chip *chip;
  int index;
  pthread_t thread;
  pthread_cond_t cond; /* work available */
  struct calrt_job *queue[CALRT_QUEUE_DEPTH]; /* FIFO; queue[0] runs first */
  int n_queued;
  atomic_int queued_hint; /* n_queued for the worker's spin (written under chip->mu, read without) */
  double free_at_us; /* modeled end of the engine's last job (chip->mu) */
  calrt_counters counters;
  atomic_ullong timeouts; /* atomic: counted by waiters without the chip lock */
  /* Completion eventfd (calrt_sim_engine_completion_fd), -1 until first asked for. Guarded by chip->mu
   * (created and written under it; closed after the worker was joined). */
  int completion_fd;
  sim_fault faults[SIM_MAX_FAULTS];
  sim_pool *pool; /* the worker thread's own (created on its first computing job; only it touches it) */
} sim_engine;

/* The engine worker's poll for its next job before it sleeps (engine.c, wait_for_job): its cap and
 * current window in microseconds. Cap: CALRT_SIM_ENGINE_SPIN_US (0: never poll), else the default
 * when the worker may run on two CPUs or more, else 0. */
#define SIM_ENGINE_SPIN_CAP_US 200.0
#define SIM_ENGINE_SPIN_MIN_US 10.0
typedef struct sim_engine_poll {
  double cap, window;
} sim_engine_poll;
sim_engine_poll sim_engine_poll_new(void);
void sim_engine_poll_missed(sim_engine_poll *p, double idle_us);

typedef struct sim_chip {
  struct calrt_device *dev;
  int index;
  pthread_mutex_t mu; /* guards everything of the chip: queues, KV metadata, counters, calbins */
  pthread_cond_t changed; /* job completed / reset progress / abort requested */
  sim_engine engines[2];
  uint64_t dram_capacity, dram_used;
  int faulted, dma_unknown, resetting;
  double shared_free_at_us; /* timing model: when the chip's shared datapath frees up */
  uint64_t rng;             /* completion jitter */
  int stop;
} sim_chip;

struct calrt_device {
  int open;
  calrt_device_info info;
  int null_compute;
  int64_t jitter_us;
  sim_chip chips[CALRT_MAX_CHIPS];
  pthread_mutex_t mu; /* guards calbin list + ids */
  struct calrt_calbin *calbins; /* linked list */
  int32_t next_calbin_id;
  atomic_int next_kv_group_id;
  atomic_llong next_job_id;
  /* Engines (of every chip) computing a job on their pools right now: the host's CPUs are shared
   * among them (sim_pool_share; pool.c). */
  atomic_int computing;
};

struct calrt_calbin {
  struct calrt_calbin *next;
  calrt_device *dev;
  sim_chip *chip;
  int32_t id;
  calrt_model_desc m;
  calrt_profile p;
  calrt_timing t;
  int32_t n_tensors;
  calrt_tensor_info *tinfo;
  const float *embed, *final_norm, *lm_head;
  const float *rope_freqs; /* [head_dim / 2] RoPE frequency divisors (Llama 3.1+), or NULL */
  sim_layer *layers;
  int has_weights;
  int configured, needs_reconfigure;
  uint64_t own_bytes;    /* this calbin's own pools (activation scratch), charged while configured */
  uint64_t shared_bytes; /* weights + KV: charged by the calbin's KV group once */
  uint64_t kv_seq_bytes; /* per sequence */
  sim_kvgroup *kv;       /* its KV group: own (configure) or joined (calrt_calbin_share_kv); chip->mu */
  int kv_joined;         /* kv was joined from another calbin (so shared_bytes are not this one's) */
  sim_seq *seqs;         /* == kv->seqs while kv != NULL (alias kept for the kernels), else NULL */
  int inflight;          /* jobs queued or running (chip->mu) */
};

typedef enum job_kind { JOB_PREFILL = 0, JOB_DECODE = 1 } job_kind;
typedef enum job_state { JOB_CREATED = 0, JOB_QUEUED, JOB_RUNNING, JOB_DONE } job_state;

struct calrt_job {
  atomic_int refs;
  int64_t id;
  calrt_calbin *cb; /* NULL after completion: the calbin may be gone */
  struct sim_chip *chip; /* static storage: always valid */
  job_kind kind;
  /* A prefill whose output has one lane per token (calrt_job_create_prefill_all): lanes == n_tok, lane
   * i the logits of position positions[0] + i. Every lane is valid and names the one sequence
   * (seq_ids[l] == seq_ids[0], positions[l] == positions[0] + l once validated); per-sequence work
   * (users, busy, validation, KV commit, fault marking) goes over sim_job_seq_lanes() lanes only. */
  int all_logits;
  int32_t lanes;  /* output lanes: 1 for prefill, n_tok for a prefill-all, B for decode */
  int32_t n_tok;  /* prefill tokens */
  int32_t *tokens, *seq_ids, *positions;
  uint8_t *valid;
  float *logits;
  int64_t *echo;
  uint64_t *checksum;
  double device_us;
  double submit_us; /* when calrt_submit queued it (chip->mu) */
  int engine;
  job_state state; /* chip->mu before completion; then job->mu */
  atomic_int abort;
  int fault; /* -1 or calrt_sim_fault */
  int32_t fault_lane;
  calrt_job_status status;
  pthread_mutex_t mu; /* own lock: wait() must not depend on the chip/calbin outliving the job */
  pthread_cond_t cond;
  int done;
  int submitted; /* job->mu */
  int32_t vocab;
  /* A decode of calrt_job_create_decode_steps: `steps` steps (1 for any other job), lane l's own
   * lane_steps[l] <= steps of them (NULL unless steps > 1: then every lane `steps`), the argmax of
   * each step's logits per lane in step_tokens[lanes, steps] (NULL unless steps > 1). */
  int32_t steps;
  int32_t *lane_steps;
  int32_t *step_tokens;
};

/* The lanes of a job that name its sequences, each a distinct one when valid: every lane of a decode,
 * lane 0 of a prefill (a prefill-all's other lanes name the same sequence again: counting them would
 * take its users, KV commit and the like n times). */
static inline int32_t sim_job_seq_lanes(const struct calrt_job *j) {
  return j->kind == JOB_PREFILL ? 1 : j->lanes;
}

/* The KV positions a job writes (and commits, when it completes OK) for the sequence of `lane`: a
 * prefill's tokens, a decode lane's steps. */
static inline int32_t sim_job_kv_tokens(const struct calrt_job *j, int32_t lane) {
  return j->kind == JOB_PREFILL ? j->n_tok : j->lane_steps ? j->lane_steps[lane] : j->steps;
}

/* errors.c-ish helpers (device.c) */
calrt_status sim_err(calrt_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* timing.c */
double sim_now_us(void);

/* profile.c: CALRT_SIM_PROFILE=1 -> decode steps' wall time per phase, printed at exit. */
enum { SIM_PROF_NORMS, SIM_PROF_QKV, SIM_PROF_ROPE_KV, SIM_PROF_ATTN, SIM_PROF_O, SIM_PROF_GATE_UP, SIM_PROF_DOWN,
       SIM_PROF_LM_HEAD, SIM_PROF_PHASES };
int sim_prof_enabled(void);
/* One decode step: phase_us[SIM_PROF_PHASES], the owner's wait at region ends, the pool regions run. */
void sim_prof_add(int rows, const double *phase_us, double wait_us, long long regions);
void sim_deadline_ts(double at_us, struct timespec *ts);
void sim_cond_init(pthread_cond_t *c);
uint64_t sim_rng_next(uint64_t *state);
double sim_modeled_us(const calrt_calbin *cb, const calrt_job *job);

/* faults.c */
int sim_fault_take(sim_engine *e, int32_t *lane); /* -1 if none hits this submit */
void sim_apply_crosstalk(calrt_job *job, int32_t lane);

/* kv.c */
uint64_t sim_kv_seq_bytes(const calrt_calbin *cb);
sim_kvgroup *sim_kvgroup_new(calrt_calbin *cb); /* refs = 1; NULL on host OOM */
void sim_kvgroup_unref(sim_chip *ch, sim_kvgroup *g); /* chip->mu held; frees + uncharges at 0 */
void sim_kv_invalidate_all(calrt_calbin *cb);

/* matmul.c: the linear layers (see matmul.c for the reduction every path computes bitwise alike). */
typedef enum sim_isa_id {
  SIM_ISA_DEFAULT = 0,
  SIM_ISA_AVX2 = 1,
  SIM_ISA_AVX512 = 2,
  SIM_ISA_AVX512Z = 3,
  SIM_ISA_COUNT = 4
} sim_isa_id;
sim_isa_id sim_isa(void); /* the path in use: the CPU's best, or CALRT_SIM_ISA's */
int sim_isa_supported(sim_isa_id isa);
const char *sim_isa_name(sim_isa_id isa);
/* Y[r * out + o] = W[o, :] . X[r, :] for o in [o0, o1), r in [0, R). */
void sim_matmul_range_isa(sim_isa_id isa, const float *W, int out, int in, const float *X, int R, float *Y,
                          int o0, int o1);
float sim_dot_ref(const float *w, const float *x, int n); /* the reduction, in plain scalar code */
/* One pass over a chunk of weight rows serves sim_row_block(in) rows of X (~256 KiB of X: L2); when
 * X has more rows, a task's chunk (at most SIM_CHUNK_FLOATS) stays in L2 across the passes. */
#define SIM_XBLOCK_FLOATS (64 * 1024)
#define SIM_CHUNK_FLOATS (64 * 1024)
int sim_row_block(int in);

/* vexp.c: expf elementwise, 8 at a time, bitwise equal to the C library's expf (checked against this
 * process's expf once; scalar expf where it does not match or the CPU lacks FMA). */
typedef enum sim_vexp_id { SIM_VEXP_SCALAR = 0, SIM_VEXP_AVX2 = 1, SIM_VEXP_AVX512 = 2, SIM_VEXP_COUNT = 3 } sim_vexp_id;
sim_vexp_id sim_vexp_mode(void);
const char *sim_vexp_name(sim_vexp_id m);
int sim_vexp_supported(sim_vexp_id m); /* can this CPU run path m */
extern const uint64_t sim_vexp_tab[32];
void sim_vexp_n(sim_vexp_id m, const float *x, float *y, int n); /* y = expf(x) on path m (tests) */
void sim_silu_mul(float *g, const float *u, int n);                /* g = (g / (1 + expf(-g))) * u */
void sim_exp_shift(float *x, int n, float m);                      /* x = expf(x - m) */

/* hugepages.c: 2 MiB pages under the caller's weight buffers where possible (a hint). */
void sim_weights_hugepages(const calrt_tensor *t, size_t n);

/* kernels.c: run the forward pass of `job` (rows: prefill tokens or valid decode lanes). Writes KV at
 * the rows' positions (not committing), logits of output lanes. Returns 0, or 1 if aborted. */
int sim_forward(calrt_calbin *cb, calrt_job *job, int null_compute, sim_pool *pool);
void sim_null_logits(const calrt_calbin *cb, int32_t token, int32_t position, float *out);

/* engine.c */
int sim_engines_start(sim_chip *chip);
void sim_engines_stop(sim_chip *chip);
int sim_engine_completion_fd(sim_engine *e); /* chip->mu held; creates on first use; -1 on failure */

#endif
