/*
 * calrt.h — the CalRT C API as calserve uses it (modelled on CalRT 0.7.6, spec §1, §3, §9, §11-14).
 *
 * This is the ONLY header the CPython binding (ext/calserve_calrt.c) includes for the runtime. The
 * software runtime (ext/calrt/sim, "calrt-sim") implements it; a vendor libcalrt that implements the
 * same declarations can be linked instead (build with CALRT_IMPL=vendor CALRT_HOME=...), with no
 * Python change. Sim-only debug entry points live in calrt_sim.h and are looked up with dlsym().
 *
 * Objects
 *   calrt_device  the process's one VirtualDevice. It has 1 chip (calrt-0.7.6) or 2 chips (sim-next,
 *                 chip-scoped configure); each chip has its own DRAM, PING and PONG job engines (one
 *                 worker each, queue depth CALRT_QUEUE_DEPTH) and reset domain.
 *   calrt_calbin  one compiled batch profile of a model (CreateCalbin); configure charges chip DRAM for
 *                 weights + KV + scratch; owns a KvManager of max_sequences sequences. On sim-next
 *                 (C3 shared_kv) several calbins of one model may form a KV group sharing one KvManager
 *                 and one weights + KV charge: see calrt_calbin_share_kv.
 *   calrt_job     one prefill or decode job with its own input and output buffers; reference counted
 *                 (the caller's reference + the engine's while queued/running). On sim-next (C3-style
 *                 prompt_logits) a prefill may return every prompt position's logits: see
 *                 calrt_job_create_prefill_all.
 *
 * Thread-safety: every function may be called from any thread concurrently, except that a handle
 * must not be used concurrently with (or after) the call that destroys it (calrt_device_close,
 * calrt_calbin_destroy, calrt_job_release). calrt_job_wait blocks only the calling thread.
 *
 * Reset semantics (calrt_device_reset): every job queued or running on the chip completes with
 * CALRT_JOB_ABORTED (its buffers may then be reclaimed); the call returns only after no job of the chip
 * is running any more, so no stale KV write can follow it. Every KV sequence of the chip is invalidated
 * (its id stays allocated until calrt_kv_free_sequence). Faults are cleared. The weights stay configured,
 * except after a CALRT_JOB_DMA_UNKNOWN completion: then every calbin of the chip reports
 * needs_reconfigure and refuses jobs (CALRT_E_NEEDS_RECONFIGURE) until calrt_calbin_configure().
 *
 * KV commit rule: a job's tokens are committed (committed_len += n for each of its sequences) only when
 * the job completes CALRT_JOB_OK. Decode lanes with valid=0 never write KV. A CCU fault marks the KV of
 * every sequence of the job unknown (sequence_valid = 0) and faults the chip until reset.
 *
 * Output echo (spec §7.4): every output lane carries (job_id, seq_id, position) and the 64-bit
 * checksum (calrt_checksum: 4-way word-interleaved FNV-1a) of its logits row bytes; invalid lanes echo (job_id, -1, -1), checksum 0
 * and an all-zero logits row.
 *
 * What the vendor must still confirm (spec §20) before any of the C3 capabilities below may be described
 * as supported by hardware — calrt-sim implements them for design and test only:
 *   1. exact B4/B8/B16 tensors / CSR / inactive-lane valid-mask contract and KV layout;
 *   2. per-profile calbin, golden outputs, capacity, performance and compatibility data;
 *   3. PING/PONG/parallel timing and the maximum number of jobs in flight (here CALRT_QUEUE_DEPTH);
 *   4. whether a batch job fails as a whole or per lane, and the scope of KV contamination
 *      (calrt-sim: the whole job fails, all of its sequences become unknown);
 *   5. the formal API for multi-calbin residency, chip affinity and reset domains, and whether the
 *      calbins of one model can share weights and a KvManager (calrt-sim: calrt_calbin_share_kv);
 *   6. versions/API/device selection for more than one physical device after 0.7.6;
 *   7. a pollable completion notification per job engine (calrt-sim: calrt_sim_engine_completion_fd,
 *      an eventfd incremented on every completion), so a host waits in its event loop instead of a
 *      thread blocked in calrt_job_wait (spec §19 M1: one wake-up per step instead of two);
 *   8. whether a calbin can return the logits of every prompt position of a prefill (the final norm +
 *      lm_head on all rows, n x vocab output) and with which output layout, so a host scores a whole
 *      prompt in one job (calrt-sim: calrt_job_create_prefill_all, capability prompt_logits);
 *   9. whether a calbin can run several greedy decode steps in one job, feeding each lane's argmax back
 *      as its next input on the device, and with which output layout (calrt-sim:
 *      calrt_job_create_decode_steps, capability multi_step);
 *   plus: the output checksum algorithm and echo layout used here (4-way word-interleaved FNV-1a 64 over the float32 row).
 */
#ifndef CALRT_H
#define CALRT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define CALRT_API_VERSION 1
#define CALRT_QUEUE_DEPTH 2 /* jobs per engine: one running + one waiting */
#define CALRT_MAX_CHIPS 2

typedef enum calrt_status {
  CALRT_OK = 0,
  CALRT_E_INVALID_ARGUMENT = 1,     /* a bad argument; the message names it */
  CALRT_E_NOT_SUPPORTED = 2,        /* operation or capability absent in this runtime profile */
  CALRT_E_ALREADY_OPEN = 3,         /* a VirtualDevice is already open in this process */
  CALRT_E_OUT_OF_DEVICE_MEMORY = 4, /* DRAM reservation does not fit (spec §13.1) */
  CALRT_E_OUT_OF_SEQUENCES = 5,     /* KvManager has no free sequence */
  CALRT_E_BUSY = 6,                 /* the engine's queue is full (DeviceBusy) */
  CALRT_E_TIMEOUT = 7,              /* wait timed out; the job is still in flight */
  CALRT_E_FAULTED = 8,              /* the chip needs a reset (or is being reset) */
  CALRT_E_NEEDS_RECONFIGURE = 9,    /* the calbin must be configured again (after DMA_UNKNOWN) */
  CALRT_E_IN_USE = 10,              /* jobs in flight (or calbins alive) prevent the operation */
  CALRT_E_HOST_OOM = 11,            /* host allocation failed */
  CALRT_E_INTERNAL = 12,
  CALRT_E_SEQUENCE_INVALID = 13,    /* the sequence was invalidated by a reset or a fault */
  CALRT_E_CLOSED = 14               /* the device is not open */
} calrt_status;

typedef enum calrt_job_status {
  CALRT_JOB_OK = 0,
  CALRT_JOB_ABORTED = 1,     /* reset while queued/running; outputs are zero */
  CALRT_JOB_CCU_FAULT = 2,   /* compute fault: chip needs reset; the job's KV is unknown */
  CALRT_JOB_DMA_UNKNOWN = 3, /* DMA state unknown: reset AND reconfigure required */
  CALRT_JOB_INVALID = 4      /* rejected at execution (position != committed_len, sequence invalid
                                or used by another running job); nothing written */
} calrt_job_status;

typedef enum calrt_engine { CALRT_ENGINE_PING = 0, CALRT_ENGINE_PONG = 1 } calrt_engine;

typedef enum calrt_kv_dtype { CALRT_KV_FP32 = 0, CALRT_KV_BF16 = 1 } calrt_kv_dtype;

typedef struct calrt_device calrt_device;
typedef struct calrt_calbin calrt_calbin;
typedef struct calrt_job calrt_job;

/* Returns a static, human-readable message for the last failing call on this thread ("" if none). */
const char *calrt_last_error(void);

/* The checksum each output lane reports: FNV-1a 64 run as four interleaved chains over the little-endian
 * 64-bit words of the row (word i feeds chain i % 4; chain k starts at the FNV offset basis ^ k), the
 * chains folded FNV-style into one value, then the zero-padded tail bytes and the length `n`. Four
 * independent chains over words instead of one chain over bytes: ~30x faster on a 150k-entry row, and
 * verifying it stays off the host's per-step critical path. Pure; thread-safe. */
uint64_t calrt_checksum(const void *data, size_t n);

/* ---- device -------------------------------------------------------------------------------- */

typedef struct calrt_open_params {
  const char *profile; /* "calrt-0.7.6" | "sim-next" (a vendor build accepts its own name) */
  uint64_t dram_bytes; /* DRAM capacity per chip */
  int32_t device;      /* board index in [0, calrt_device_count()); 0 when left zero-initialised.
                        * One process opens one board (one process per board, spec §3); the vendor
                        * API this stands for is the open-question in spec §20 item 6. */
} calrt_open_params;

typedef struct calrt_device_info {
  char profile[32];
  char runtime[32]; /* e.g. "calrt-sim 0.7.6-compat" */
  int chips;
  int queue_depth;
  int batch_profiles; /* C3 */
  int multi_calbin;   /* C3 */
  int chip_scoped;    /* C3 */
  int pingpong;
  int do_shift; /* C1 */
  int shared_kv; /* C3, sim-next only: calrt_calbin_share_kv (KV groups across batch profiles) */
  int device;     /* the board index this VirtualDevice was opened on (calrt_open_params.device) */
  char serial[32]; /* a stable identity of that board (sim: "calrt-sim-board-<index>") */
  /* Last, so a runtime built against the header without it fills the fields before it alike (a caller
   * that zeroes the struct first then reads 0: absent). */
  int prompt_logits; /* C3-style, sim-next only: calrt_job_create_prefill_all */
  int multi_step;    /* C3-style, sim-next only: calrt_job_create_decode_steps */
} calrt_device_info;

typedef struct calrt_counters {
  uint64_t submitted; /* accepted submits */
  uint64_t completed; /* completed CALRT_JOB_OK */
  uint64_t failed;    /* completed with any other status */
  uint64_t busy;      /* submits refused with CALRT_E_BUSY */
  uint64_t timeouts;  /* waits that returned CALRT_E_TIMEOUT */
  uint64_t inflight;  /* queued + running now */
} calrt_counters;

/* The number of boards this runtime can open (calrt_open_params.device is in [0, *out)). */
calrt_status calrt_device_count(int *out);
/* Open the VirtualDevice. CALRT_E_ALREADY_OPEN if one is open in this process (until close);
 * CALRT_E_INVALID_ARGUMENT for a board index outside [0, calrt_device_count());
 * CALRT_E_INVALID_ARGUMENT for an unknown profile or zero DRAM. Starts the engine workers. */
calrt_status calrt_device_open(const calrt_open_params *params, calrt_device **out);
/* Close: CALRT_E_IN_USE while calbins exist (destroy them first; reset to abort their jobs). */
calrt_status calrt_device_close(calrt_device *dev);
calrt_status calrt_device_info_get(calrt_device *dev, calrt_device_info *out);
calrt_status calrt_device_dram(calrt_device *dev, int chip, uint64_t *capacity, uint64_t *used);
/* Reset one chip (chip = -1: all chips). See "Reset semantics" above. Blocks until the chip's running
 * jobs stopped (at most one layer of compute). */
calrt_status calrt_device_reset(calrt_device *dev, int chip);
/* faulted: the chip refuses jobs until reset. needs_reconfigure: some calbin of the chip must be
 * configured again. */
calrt_status calrt_device_state(calrt_device *dev, int chip, int *faulted, int *needs_reconfigure);
calrt_status calrt_engine_counters(calrt_device *dev, int chip, calrt_engine engine,
                                   calrt_counters *out);

/* ---- calbin -------------------------------------------------------------------------------- */

/* The decoder family. Llama is Qwen3 without the per-head q/k RMSNorm (no q_norm/k_norm tensors);
 * Qwen2 is Llama with a bias on the q, k and v projections (self_attn.{q,k,v}_proj.bias tensors, added
 * before RoPE). Gemma 3 is Qwen3 with: the embedding times sqrt(hidden_size); the attention's output
 * RMS-normed by post_attention_layernorm before its residual add (every other family: that tensor is
 * the MLP's input norm), the MLP's input normed by pre_feedforward_layernorm and its output by
 * post_feedforward_layernorm before its add; GELU (tanh approximation) instead of SiLU; its norm
 * tensors are the multipliers themselves (Hugging Face's Gemma stores w and multiplies by 1 + w: the
 * caller adds the 1). All use the rotate-half ("neox") RoPE layout of Hugging Face checkpoints with
 * base rope_theta (sliding layers: rope_local_theta when set). Gemma 2 is Gemma 3 without the
 * per-head q/k RMSNorm (no q_norm/k_norm tensors), as Llama is Qwen3 without it; its attention and
 * final logit soft-capping are fields of calrt_model_desc (any family). Any family may have
 * sliding-window layers (calrt_model_desc). */
typedef enum calrt_arch {
  CALRT_ARCH_QWEN3 = 0,
  CALRT_ARCH_LLAMA = 1,
  CALRT_ARCH_QWEN2 = 2,
  CALRT_ARCH_GEMMA3 = 3,
  CALRT_ARCH_GEMMA2 = 4
} calrt_arch;

typedef struct calrt_model_desc { /* Qwen3 / Llama / Qwen2 / Gemma 3 / Gemma 2 decoder (Hugging Face names) */
  int32_t vocab_size, hidden_size, intermediate_size, num_hidden_layers;
  int32_t num_attention_heads, num_key_value_heads, head_dim;
  float rms_norm_eps;
  double rope_theta;
  int32_t tie_word_embeddings; /* 0: an lm_head.weight tensor is given */
  int32_t arch;                /* calrt_arch; 0 (Qwen3) when left zero */
  /* The fields below (any family) keep the behaviour of a description without them when left zero. */
  int32_t sliding_window;         /* a sliding layer's position p attends to positions
                                   * [p - sliding_window + 1, p] only; 0: no layer slides */
  int32_t sliding_window_pattern; /* N > 0: layer i (from 0) attends globally when (i + 1) % N == 0
                                   * and slides otherwise (Gemma 3: 6); 0: every layer slides */
  double rope_local_theta;        /* RoPE base of the sliding layers (Gemma 3: 10,000); 0: rope_theta */
  float query_pre_attn_scalar;    /* attention scores divided by sqrtf(it) (Gemma); 0: by sqrtf(head_dim) */
  float rope_scaling_factor;      /* linear RoPE scaling: every layer's frequencies divided by it, but the
                                   * sliding layers' that have their own base (rope_local_theta > 0: Gemma
                                   * 3's local layers stay unscaled); 0 or 1: none */
  float attn_logit_softcapping;   /* c > 0: each attention score s (after the division above) becomes
                                   * c * tanhf(s / c) before the mask and the softmax (Gemma 2: 50); 0: none */
  float final_logit_softcapping;  /* c > 0: each output logit x (after the lm_head matmul) becomes
                                   * c * tanhf(x / c) (Gemma 2: 30); 0: none */
} calrt_model_desc;

/* An optional tensor of any family: [head_dim / 2] float32 divisors of the RoPE frequencies
 * (Llama 3.1+'s "llama3" scaling: frequency i is rope_theta^(-2i/head_dim) / divisor[i]). */
#define CALRT_ROPE_FREQS_TENSOR "model.rope_freqs.weight"

typedef struct calrt_tensor {
  const char *name;  /* HF name, e.g. "model.layers.0.self_attn.q_proj.weight" */
  const float *data; /* float32, C-contiguous; NOT copied: must outlive the calbin */
  int32_t ndim;
  int64_t shape[2];
} calrt_tensor;

typedef struct calrt_profile {
  int32_t compiled_batch; /* B; > 1 needs batch_profiles (C3) */
  int32_t max_seq;        /* KV slots per sequence */
  int32_t max_sequences;  /* sequences of the KvManager */
  calrt_kv_dtype kv_dtype;
  int32_t valid_mask;      /* the profile takes a per-lane valid mask (else every lane must be valid) */
  int32_t inactive_logits; /* inactive lanes' logits rows are returned (zeros) — informational */
} calrt_profile;

typedef struct calrt_timing { /* all zero: run as fast as the kernels allow */
  double prefill_base_us, prefill_us_per_token;
  double decode_step_us;   /* for this calbin's compiled_batch */
  double pingpong_overlap; /* 0: PING and PONG serialise on the chip; 1: fully overlapped */
} calrt_timing;

typedef struct calrt_calbin_info {
  int32_t calbin_id, chip, configured, needs_reconfigure;
  calrt_model_desc model;
  calrt_profile profile;
  int32_t num_tensors;
  uint64_t dram_bytes;          /* charged while configured */
  uint64_t kv_bytes_per_token;  /* all layers, K and V */
  int32_t kv_shape[5];          /* per sequence: [layers, 2 (K,V), kv_heads, max_seq, head_dim] */
  int32_t inactive_writes_kv;   /* always 0 in calrt-sim */
  int32_t null_compute;
  /* KV group (see calrt_calbin_share_kv). A standalone configured calbin is a group of one. */
  int32_t kv_group_id;          /* 0 while the calbin has no KvManager (not configured, not joined) */
  int32_t kv_group_size;        /* calbins currently sharing the group's KvManager */
  uint64_t shared_dram_bytes;   /* weights + KV of the group, charged once while the group lives */
} calrt_calbin_info;

typedef struct calrt_tensor_info {
  char name[96];
  int32_t ndim;
  int64_t shape[2];
  char dtype[8]; /* "float32" */
} calrt_tensor_info;

/* CreateCalbin on `chip`: checks the description, tensor names/shapes (message names the tensor) and
 * capabilities (B > 1 without batch profiles, chip > 0 without chip-scoped configure -> NOT_SUPPORTED).
 * `tensors` may be NULL/0 only on a null-compute device. Charges no DRAM yet. */
calrt_status calrt_calbin_create(calrt_device *dev, int chip, const calrt_model_desc *model,
                                 const calrt_tensor *tensors, size_t n_tensors,
                                 const calrt_profile *profile, const calrt_timing *timing,
                                 calrt_calbin **out);
/* Configure (or reconfigure after DMA_UNKNOWN): charges DRAM (OUT_OF_DEVICE_MEMORY if it does not
 * fit), sets up the KvManager. NOT_SUPPORTED if another calbin is configured and multi-calbin is off.
 * A calbin that joined a KV group (calrt_calbin_share_kv) is charged only its own pools and uses the
 * group's KvManager; otherwise it starts a new group of one (weights + KV + its pools charged). */
calrt_status calrt_calbin_configure(calrt_calbin *cb);
/* ResetConfiguration: frees DRAM and every KV sequence. CALRT_E_IN_USE while jobs are in flight (on this
 * calbin). A member of a KV group only leaves the group (its own pools are freed); the group's sequences,
 * KV memory and weights charge are freed when its last member leaves. */
calrt_status calrt_calbin_reset_configuration(calrt_calbin *cb);
/* Destroy (resetting the configuration first). CALRT_E_IN_USE while jobs are in flight. */
calrt_status calrt_calbin_destroy(calrt_calbin *cb);
calrt_status calrt_calbin_info_get(calrt_calbin *cb, calrt_calbin_info *out);

/* ---- shared KV across batch profiles (C3: sim-next only, NOT described as hardware-supported) -----
 *
 * calrt_calbin_share_kv(cb, owner), called between calrt_calbin_create(cb) and its first
 * calrt_calbin_configure(cb), makes cb a member of owner's KV group: cb uses the group's KvManager
 * (sequence ids, committed lengths, valid flags, KV memory) and the group's weights, so configure
 * charges DRAM only for cb's own pools (activation scratch). This is what lets an engine run one sequence
 * at B1 under low load and in a B16 batch under high load (spec §8) without moving KV.
 *
 *   - capability: calrt_device_info.shared_kv; without it CALRT_E_NOT_SUPPORTED (calrt-0.7.6).
 *   - owner: any configured calbin of the group (not needing a reconfigure: else NEEDS_RECONFIGURE) on
 *     the same chip, with the same model description, the very same weight buffers (pointer equality,
 *     per tensor), and the same max_seq, max_sequences and kv_dtype; compiled_batch, valid_mask and
 *     timing may differ. Anything else: CALRT_E_INVALID_ARGUMENT naming what differs.
 *   - KvManager calls on any member act on the shared sequences. A job on any member reads/writes
 *     them; the concurrency rules are group-wide (a sequence written by a running job of one member is
 *     INVALID for a job of another; a sequence used by a job in flight on any member is IN_USE).
 *   - release: any member (the owner too) may be reset/destroyed whenever it has no job in flight; the
 *     group lives (refcount) until its last member leaves, then its KV and weights charge are freed.
 *   - reset invalidates the group's sequences (once; idempotent); after DMA_UNKNOWN every configured
 *     member reports needs_reconfigure and is configured again individually.
 * Vendor confirmation needed (spec §20 item 5): whether calbins of one model can share weights and a
 * KvManager, and the formal API for it. */
calrt_status calrt_calbin_share_kv(calrt_calbin *cb, calrt_calbin *owner);
calrt_status calrt_calbin_tensor_info(calrt_calbin *cb, int32_t index, calrt_tensor_info *out);

/* ---- KvManager (per calbin) ---------------------------------------------------------------- */

calrt_status calrt_kv_can_allocate(calrt_calbin *cb, int32_t n, int *ok);
calrt_status calrt_kv_create_sequence(calrt_calbin *cb, int32_t *seq_id); /* OUT_OF_SEQUENCES */
/* IN_USE if a queued/running job uses it; INVALID_ARGUMENT if not allocated. */
calrt_status calrt_kv_free_sequence(calrt_calbin *cb, int32_t seq_id);
calrt_status calrt_kv_committed_len(calrt_calbin *cb, int32_t seq_id, int32_t *len); /* SEQUENCE_INVALID */
calrt_status calrt_kv_sequence_valid(calrt_calbin *cb, int32_t seq_id, int *valid);
calrt_status calrt_kv_remove_tokens_at_end(calrt_calbin *cb, int32_t seq_id, int32_t n);
/* DoShift (C1): drop the first n tokens; the rest keep their stored (RoPE-rotated) K/V. */
calrt_status calrt_kv_do_shift(calrt_calbin *cb, int32_t seq_id, int32_t n);
/* Not supported in 0.7.6 (spec §9.3): always CALRT_E_NOT_SUPPORTED. */
calrt_status calrt_kv_copy_prefix(calrt_calbin *cb, int32_t src, int32_t dst, int32_t n);
calrt_status calrt_kv_keep_one(calrt_calbin *cb, int32_t seq_id);
calrt_status calrt_kv_position_add(calrt_calbin *cb, int32_t seq_id, int32_t delta);
calrt_status calrt_kv_position_div(calrt_calbin *cb, int32_t seq_id, int32_t divisor);
calrt_status calrt_kv_save_session(calrt_calbin *cb, int32_t seq_id, void *buf, size_t *n);
calrt_status calrt_kv_load_session(calrt_calbin *cb, int32_t seq_id, const void *buf, size_t n);

/* ---- jobs ---------------------------------------------------------------------------------- */

typedef struct calrt_job_result {
  int64_t job_id;
  calrt_job_status status;
  int32_t lanes, vocab;    /* lanes: 1 (prefill), n (prefill_all), compiled_batch (decode) */
  const float *logits;     /* [lanes, vocab]; valid until calrt_job_release */
  const int64_t *echo;     /* [lanes, 3] (job_id, seq_id, position) */
  const uint64_t *checksum;/* [lanes] */
  double device_us;        /* time from the job's start on the engine (it has the device) to its completion
                            * on the device, by the device's clock (the software runtime: the modeled
                            * span, or the computation when longer; a failed job: to its report) */
} calrt_job_result;

/* A prefill job: the whole prompt (n >= 1 tokens) appended at the sequence's committed_len; one output
 * lane (logits of the last position). Inputs are copied into the job's own buffer. */
calrt_status calrt_job_create_prefill(calrt_calbin *cb, int32_t seq_id, const int32_t *tokens,
                                      int32_t n, calrt_job **out);

/* ---- prompt logits (C3-style: sim-next only, NOT described as hardware-supported) ---------------
 *
 * A prefill job whose output has one lane per prompt token: exactly calrt_job_create_prefill (the same
 * argument checks and messages, KV effect: all n tokens appended at committed_len and committed only
 * when the job completes CALRT_JOB_OK; the same faults, timing model and abort behaviour), except that
 * lane i (0 <= i < n) holds the logits after tokens[0..i], i.e. of position committed_len + i, and
 * echoes (job_id, seq_id, committed_len + i) with checksum = calrt_checksum of its row. Lane n - 1 is
 * the one lane of the equivalent calrt_job_create_prefill; in calrt-sim lane i is bitwise the lane of a
 * calrt_job_create_prefill of tokens[0..i] at the same committed_len (each row's computation is the
 * same sequence of float operations whatever the job's other rows: see kernels.c). A host scores the
 * whole prompt (each token's log-probability under the tokens before it) in one job instead of one
 * decode step per prompt token. A non-OK completion zeroes every lane (as for any job); a CCU fault
 * leaves the sequence unknown; a crosstalk fault corrupts one lane (lane % n).
 *
 *   - capability: calrt_device_info.prompt_logits; without it CALRT_E_NOT_SUPPORTED (calrt-0.7.6).
 *   - host memory: the job's output is n * vocab floats (plus n echo rows and checksums);
 *     CALRT_E_HOST_OOM when it cannot be allocated.
 * Vendor confirmation needed (spec §20, item 8 above): whether a calbin can output the logits of every
 * prefill position, and the formal API and output layout for it. */
calrt_status calrt_job_create_prefill_all(calrt_calbin *cb, int32_t seq_id, const int32_t *tokens,
                                          int32_t n, calrt_job **out);
/* A decode step over `lanes` == compiled_batch lanes. Valid lanes must name distinct allocated
 * sequences, tokens in [0, vocab), positions in [0, max_seq). */
calrt_status calrt_job_create_decode(calrt_calbin *cb, const int32_t *seq_ids, const int32_t *tokens,
                                     const int32_t *positions, const uint8_t *valid, int32_t lanes,
                                     calrt_job **out);

/* ---- multi-step greedy decode (C3-style: sim-next only, NOT described as hardware-supported) ------
 *
 * calrt_job_create_decode_steps(..., steps, lane_steps, out): one job that runs up to `steps` decode
 * steps over the same lanes; lane l runs lane_steps[l] of them (NULL: every lane `steps`), then
 * rests (as an invalid lane would) while the others go on. Step 0 is exactly calrt_job_create_decode's step (tokens[l] at positions[l]); each following
 * step feeds every valid lane the argmax of its previous step's logits (the first index of the
 * largest value; a NaN counts as the largest, as numpy's argmax does) at the next position. So each
 * valid lane writes KV at positions[l] .. positions[l] + n - 1 and yields n = lane_steps[l] tokens,
 * the greedy continuation a host would get from n single-step jobs, bitwise (the kernels' rows do
 * not depend on the job's other rows). A host pays its per-job work (pick, submit, wait, verify) once
 * per `steps` tokens of every lane.
 *
 *   - arguments: those of calrt_job_create_decode, plus steps in [1, CALRT_MAX_DECODE_STEPS], each
 *     valid lane's lane_steps[l] in [1, steps] and positions[l] + lane_steps[l] <= max_seq (else
 *     CALRT_E_INVALID_ARGUMENT naming it). A host gives a lane fewer steps when its request has fewer
 *     tokens left (max_tokens) or less KV room than the job's other lanes.
 *   - KV commit: committed_len += lane_steps[l] for each valid lane, only when the job completes
 *     CALRT_JOB_OK (a fault leaves every sequence of the job unknown, as for any job).
 *   - outputs: each lane's logits row, echo and checksum are its LAST step's (echo position =
 *     positions[l] + lane_steps[l] - 1); calrt_job_step_tokens gives the tokens, [lanes, steps]
 *     int32, lane l's token k being the argmax of its step k's logits for k < lane_steps[l] (so its
 *     last one is the argmax of its returned row), 0 after. Invalid lanes and a job that did not
 *     complete OK: all zeros.
 *   - timing model: steps x decode_step_us; an abort (reset) stops it between steps or inside one.
 *   - capability: calrt_device_info.multi_step; without it CALRT_E_NOT_SUPPORTED (calrt-0.7.6).
 * Vendor confirmation needed (spec §20, item 9 above): on-device argmax and token feedback, and the
 * formal API and output layout for it. */
#define CALRT_MAX_DECODE_STEPS 64
calrt_status calrt_job_create_decode_steps(calrt_calbin *cb, const int32_t *seq_ids, const int32_t *tokens,
                                           const int32_t *positions, const uint8_t *valid, int32_t lanes,
                                           int32_t steps, const int32_t *lane_steps, calrt_job **out);
/* The step tokens of a completed job of calrt_job_create_decode_steps: *tokens = [lanes, steps] int32
 * (valid until calrt_job_release), *steps. INVALID_ARGUMENT for any other job or one not completed. */
calrt_status calrt_job_step_tokens(calrt_job *job, const int32_t **tokens, int32_t *steps);

int64_t calrt_job_id(const calrt_job *job);
/* Submit to an engine. BUSY (queue full), FAULTED (chip needs reset / resetting), NEEDS_RECONFIGURE,
 * INVALID_ARGUMENT (already submitted), NOT_SUPPORTED (PONG without ping/pong). */
calrt_status calrt_job_submit(calrt_job *job, calrt_engine engine);
/* Wait up to timeout_us (< 0: forever). CALRT_OK with *status set, or CALRT_E_TIMEOUT (still in
 * flight; counted). Waiting on a job never submitted: INVALID_ARGUMENT. */
calrt_status calrt_job_wait(calrt_job *job, int64_t timeout_us, calrt_job_status *status);
int calrt_job_done(calrt_job *job);
/* The outputs of a completed job (INVALID_ARGUMENT if not completed). */
calrt_status calrt_job_result_get(calrt_job *job, calrt_job_result *out);
/* Drop the caller's reference. Safe while the job is in flight (the engine keeps its own). */
void calrt_job_release(calrt_job *job);

#ifdef __cplusplus
}
#endif
#endif /* CALRT_H */
