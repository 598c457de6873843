/* calserve._calrt — the tiny CPython binding over calrt.h (and, if present, calrt_sim.h via dlsym).
 *
 * Why this shape: everything Python-facing (types, enums, validation messages) lives in
 * calserve/runtime/device.py; this file only moves handles and buffers and turns a calrt_status into
 * `_calrt.Error(message)` with `.code`. It releases the GIL around every call that can block or compute,
 * borrows the weight buffers (no copy: Py_buffer views held until release) and returns the job outputs as
 * numpy views whose base keeps the C job alive (no copy).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>

#include <dlfcn.h>
#include <string.h>

#include "calrt.h"
#include "host_steps.h"

static PyObject *Error;

/* Sim-only entry points (calrt_sim.h), declared here so a vendor build needs no sim header. */
typedef calrt_status (*inject_fn)(calrt_device *, int, calrt_engine, int, int32_t, int32_t);
typedef calrt_status (*simcfg_fn)(calrt_device *, int, int64_t, uint64_t);
typedef calrt_status (*readkv_fn)(calrt_calbin *, int32_t, void *, size_t *);
/* C3 calrt.h extension (shared KV): optional, so a vendor libcalrt without it still links. */
typedef calrt_status (*sharekv_fn)(calrt_calbin *, calrt_calbin *);
static inject_fn p_inject;
static simcfg_fn p_simcfg;
static readkv_fn p_readkv;
static sharekv_fn p_sharekv;
/* C3-style calrt.h extension (prompt logits): optional likewise; absent, submit_prefill_all reports
 * NOT_SUPPORTED and the capabilities say prompt_logits False whatever the runtime profile claims. */
typedef calrt_status (*prefill_all_fn)(calrt_calbin *, int32_t, const int32_t *, int32_t, calrt_job **);
static prefill_all_fn p_prefill_all;
/* C3-style calrt.h extension (multi-step greedy decode): optional likewise (both entry points). */
typedef calrt_status (*decode_steps_fn)(calrt_calbin *, const int32_t *, const int32_t *, const int32_t *,
                                        const uint8_t *, int32_t, int32_t, const int32_t *, calrt_job **);
typedef calrt_status (*step_tokens_fn)(calrt_job *, const int32_t **, int32_t *);
static decode_steps_fn p_decode_steps;
static step_tokens_fn p_step_tokens;
/* Optional completion notification fd per job engine (calrt_sim_engine_completion_fd, spec §19 M1). */
typedef calrt_status (*cfd_fn)(calrt_device *, int, calrt_engine, int *);
static cfd_fn p_cfd;

static void resolve_sim(void) {
  Dl_info info;
  if (!dladdr((void *)&calrt_device_open, &info) || !info.dli_fname) return;
  void *h = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
  if (!h) return;
  p_inject = (inject_fn)dlsym(h, "calrt_sim_inject_fault");
  p_simcfg = (simcfg_fn)dlsym(h, "calrt_sim_configure");
  p_readkv = (readkv_fn)dlsym(h, "calrt_sim_read_kv");
  p_sharekv = (sharekv_fn)dlsym(h, "calrt_calbin_share_kv");
  p_prefill_all = (prefill_all_fn)dlsym(h, "calrt_job_create_prefill_all");
  p_cfd = (cfd_fn)dlsym(h, "calrt_sim_engine_completion_fd");
  p_decode_steps = (decode_steps_fn)dlsym(h, "calrt_job_create_decode_steps");
  p_step_tokens = (step_tokens_fn)dlsym(h, "calrt_job_step_tokens");
  if (!p_decode_steps || !p_step_tokens) p_decode_steps = NULL, p_step_tokens = NULL;
  /* keep the handle: the library stays loaded for the process anyway */
}

static PyObject *raise_code(calrt_status st, const char *msg) {
  PyObject *exc = PyObject_CallFunction(Error, "s", msg && *msg ? msg : "CalRT call failed");
  if (!exc) return NULL;
  PyObject *code = PyLong_FromLong((long)st);
  PyObject_SetAttrString(exc, "code", code);
  Py_XDECREF(code);
  PyErr_SetObject(Error, exc);
  Py_DECREF(exc);
  return NULL;
}

/* The message is thread-local in the runtime: read it on the thread that made the call. */
#define CALL(expr)                                  \
  do {                                              \
    calrt_status st_;                               \
    char msg_[256];                                 \
    Py_BEGIN_ALLOW_THREADS st_ = (expr);            \
    snprintf(msg_, sizeof msg_, "%s", calrt_last_error()); \
    Py_END_ALLOW_THREADS if (st_ != CALRT_OK) return raise_code(st_, msg_); \
  } while (0)

static PyObject *not_supported(const char *what) {
  char m[160];
  snprintf(m, sizeof m, "%s is a calrt-sim debug entry point, absent from this runtime build", what);
  return raise_code(CALRT_E_NOT_SUPPORTED, m);
}

/* ------------------------------------------------------------------ Device */
typedef struct {
  PyObject_HEAD calrt_device *dev;
} DeviceObject;

typedef struct {
  PyObject_HEAD DeviceObject *owner;
  calrt_calbin *cb;
  Py_buffer *bufs;
  Py_ssize_t n_bufs;
  int32_t id, lanes, kv_bf16;
  int32_t kv_shape[5];
} CalbinObject;

typedef struct {
  PyObject_HEAD calrt_job *job;
  PyObject *calbin;
  int64_t id;
  hs_run *run; /* a host-driven multi-step decode (host_steps.h): job is NULL */
} JobObject;

static PyTypeObject DeviceType, CalbinType, JobType;

static int Device_init(DeviceObject *self, PyObject *args, PyObject *kw) {
  const char *profile;
  unsigned long long dram;
  int null_compute;
  long long jitter;
  unsigned long long seed;
  int device = 0;
  if (!PyArg_ParseTuple(args, "sKpLK|i", &profile, &dram, &null_compute, &jitter, &seed, &device)) return -1;
  if (self->dev) {
    PyErr_SetString(PyExc_RuntimeError, "already initialised");
    return -1;
  }
  calrt_open_params p = {.profile = profile, .dram_bytes = dram, .device = device};
  calrt_device *d = NULL;
  calrt_status st;
  char msg[256];
  Py_BEGIN_ALLOW_THREADS st = calrt_device_open(&p, &d);
  snprintf(msg, sizeof msg, "%s", calrt_last_error());
  Py_END_ALLOW_THREADS if (st) {
    raise_code(st, msg);
    return -1;
  }
  if (null_compute || jitter > 0) {
    if (!p_simcfg) {
      calrt_device_close(d);
      not_supported("null_compute/completion_jitter");
      return -1;
    }
    st = p_simcfg(d, null_compute, jitter, seed);
    if (st) {
      snprintf(msg, sizeof msg, "%s", calrt_last_error());
      calrt_device_close(d);
      raise_code(st, msg);
      return -1;
    }
  }
  self->dev = d;
  return 0;
}

static PyObject *Device_close(DeviceObject *self, PyObject *noargs) {
  if (self->dev) {
    CALL(calrt_device_close(self->dev));
    self->dev = NULL;
  }
  Py_RETURN_NONE;
}

static void Device_dealloc(DeviceObject *self) {
  if (self->dev) {
    calrt_device_reset(self->dev, -1);
    calrt_device_close(self->dev);
  }
  Py_TYPE(self)->tp_free((PyObject *)self);
}

#define NEED_DEV(self)                                                            \
  if (!(self)->dev) return raise_code(CALRT_E_CLOSED, "the device is closed")

static PyObject *Device_capabilities(DeviceObject *self, PyObject *noargs) {
  NEED_DEV(self);
  calrt_device_info i;
  memset(&i, 0, sizeof i); /* a runtime whose calrt_device_info ends before prompt_logits leaves it 0 */
  CALL(calrt_device_info_get(self->dev, &i));
  return Py_BuildValue("{s:s,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:s,s:i,s:i}", "profile", i.profile,
                       "runtime", i.runtime, "chips", i.chips, "queue_depth", i.queue_depth, "batch_profiles",
                       i.batch_profiles, "multi_calbin", i.multi_calbin, "chip_scoped", i.chip_scoped,
                       "pingpong", i.pingpong, "do_shift", i.do_shift, "sim_debug", p_inject != NULL,
                       "shared_kv", p_sharekv != NULL && i.shared_kv, "device", i.device,
                       "serial", i.serial, "prompt_logits", p_prefill_all != NULL && i.prompt_logits,
                       "multi_step", p_decode_steps != NULL && i.multi_step);
}

static PyObject *Device_dram(DeviceObject *self, PyObject *args) {
  int chip;
  if (!PyArg_ParseTuple(args, "i", &chip)) return NULL;
  NEED_DEV(self);
  uint64_t cap, used;
  CALL(calrt_device_dram(self->dev, chip, &cap, &used));
  return Py_BuildValue("(KK)", (unsigned long long)cap, (unsigned long long)used);
}

static PyObject *Device_reset(DeviceObject *self, PyObject *args) {
  int chip;
  if (!PyArg_ParseTuple(args, "i", &chip)) return NULL;
  NEED_DEV(self);
  CALL(calrt_device_reset(self->dev, chip));
  Py_RETURN_NONE;
}

static PyObject *device_state(DeviceObject *self, PyObject *args, int which) {
  int chip, f = 0, nr = 0;
  if (!PyArg_ParseTuple(args, "i", &chip)) return NULL;
  NEED_DEV(self);
  CALL(calrt_device_state(self->dev, chip, &f, &nr));
  return PyBool_FromLong(which ? nr : f);
}
static PyObject *Device_faulted(DeviceObject *s, PyObject *a) { return device_state(s, a, 0); }
static PyObject *Device_needs_reconfigure(DeviceObject *s, PyObject *a) { return device_state(s, a, 1); }

static PyObject *Device_counters(DeviceObject *self, PyObject *args) {
  int chip, engine;
  if (!PyArg_ParseTuple(args, "ii", &chip, &engine)) return NULL;
  NEED_DEV(self);
  calrt_counters c;
  CALL(calrt_engine_counters(self->dev, chip, (calrt_engine)engine, &c));
  return Py_BuildValue("(KKKKKK)", (unsigned long long)c.submitted, (unsigned long long)c.completed,
                       (unsigned long long)c.failed, (unsigned long long)c.busy,
                       (unsigned long long)c.timeouts, (unsigned long long)c.inflight);
}

static PyObject *Device_inject_fault(DeviceObject *self, PyObject *args) {
  int chip, engine, kind, nth, lane;
  if (!PyArg_ParseTuple(args, "iiiii", &chip, &engine, &kind, &nth, &lane)) return NULL;
  NEED_DEV(self);
  if (!p_inject) return not_supported("inject_fault");
  CALL(p_inject(self->dev, chip, (calrt_engine)engine, kind, nth, lane));
  Py_RETURN_NONE;
}

/* completion_fd(chip, engine) -> int: the engine's completion eventfd, owned by the runtime (never
 * close it; it is closed with the device). NOT_SUPPORTED when the runtime build lacks it. */
static PyObject *Device_completion_fd(DeviceObject *self, PyObject *args) {
  int chip, engine, fd = -1;
  if (!PyArg_ParseTuple(args, "ii", &chip, &engine)) return NULL;
  NEED_DEV(self);
  if (!p_cfd) return raise_code(CALRT_E_NOT_SUPPORTED, "completion_fd: this runtime build has no completion "
                                "notification fd (calrt_sim_engine_completion_fd)");
  CALL(p_cfd(self->dev, chip, (calrt_engine)engine, &fd));
  return PyLong_FromLong(fd);
}

static void release_bufs(CalbinObject *c) {
  for (Py_ssize_t i = 0; i < c->n_bufs; i++) PyBuffer_Release(&c->bufs[i]);
  PyMem_Free(c->bufs);
  c->bufs = NULL;
  c->n_bufs = 0;
}

/* load_calbin(chip, model (.., tie, arch, sliding_window, sliding_window_pattern, rope_local_theta,
 * query_pre_attn_scalar, rope_scaling_factor, attn_logit_softcapping, final_logit_softcapping), tensors,
 * profile, timing, kv_owner=None) -> Calbin: create (+ share_kv) + configure. */
static PyObject *Device_load_calbin(DeviceObject *self, PyObject *args) {
  int chip;
  PyObject *tensors, *owner_obj = Py_None;
  calrt_model_desc m;
  calrt_profile p;
  calrt_timing t;
  int tie, kvd, vm, il, arch = CALRT_ARCH_QWEN3;
  double eps, qpas, rsf, acap, fcap;
  memset(&m, 0, sizeof m);
  if (!PyArg_ParseTuple(args, "i(iiiiiiiddpiiiddddd)O(iiiipp)(dddd)|O", &chip, &m.vocab_size, &m.hidden_size,
                        &m.intermediate_size, &m.num_hidden_layers, &m.num_attention_heads,
                        &m.num_key_value_heads, &m.head_dim, &eps, &m.rope_theta,
                        &tie, &arch, &m.sliding_window, &m.sliding_window_pattern, &m.rope_local_theta, &qpas,
                        &rsf, &acap, &fcap, &tensors, &p.compiled_batch, &p.max_seq, &p.max_sequences, &kvd, &vm, &il,
                        &t.prefill_base_us, &t.prefill_us_per_token, &t.decode_step_us,
                        &t.pingpong_overlap, &owner_obj))
    return NULL;
  NEED_DEV(self);
  calrt_calbin *kv_owner = NULL;
  if (owner_obj != Py_None) {
    if (!PyObject_TypeCheck(owner_obj, &CalbinType)) {
      PyErr_SetString(PyExc_TypeError, "kv_owner must be a Calbin or None");
      return NULL;
    }
    CalbinObject *oo = (CalbinObject *)owner_obj;
    if (!oo->cb || oo->owner != self) return raise_code(CALRT_E_INVALID_ARGUMENT, "kv_owner: the calbin was "
                                                        "released or belongs to another device");
    if (!p_sharekv) return raise_code(CALRT_E_NOT_SUPPORTED, "kv_owner: shared KV (C3) is not provided by "
                                      "this runtime build");
    kv_owner = oo->cb;
  }
  m.rms_norm_eps = (float)eps;
  m.tie_word_embeddings = tie;
  m.arch = arch;
  m.query_pre_attn_scalar = (float)qpas;
  m.rope_scaling_factor = (float)rsf;
  m.attn_logit_softcapping = (float)acap;
  m.final_logit_softcapping = (float)fcap;
  p.kv_dtype = kvd ? CALRT_KV_BF16 : CALRT_KV_FP32;
  p.valid_mask = vm;
  p.inactive_logits = il;
  PyObject *seq = PySequence_Fast(tensors, "tensors must be a sequence of (name, array)");
  if (!seq) return NULL;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  CalbinObject *cbo = PyObject_New(CalbinObject, &CalbinType);
  if (!cbo) {
    Py_DECREF(seq);
    return NULL;
  }
  cbo->owner = NULL;
  cbo->cb = NULL;
  cbo->n_bufs = 0;
  cbo->bufs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
  calrt_tensor *ts = PyMem_Calloc((size_t)(n ? n : 1), sizeof(calrt_tensor));
  if (!cbo->bufs || !ts) {
    PyMem_Free(ts);
    Py_DECREF(cbo);
    Py_DECREF(seq);
    return PyErr_NoMemory();
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
    const char *name;
    PyObject *arr;
    if (!PyArg_ParseTuple(item, "sO", &name, &arr)) goto fail;
    if (PyObject_GetBuffer(arr, &cbo->bufs[i], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) goto fail;
    cbo->n_bufs = i + 1;
    Py_buffer *b = &cbo->bufs[i];
    if (b->itemsize != 4 || !b->format || strcmp(b->format, "f") != 0 || b->ndim < 1 || b->ndim > 2) {
      PyErr_Format(PyExc_TypeError, "weights[%s]: need a C-contiguous float32 array of 1 or 2 dims", name);
      goto fail;
    }
    ts[i].name = name; /* borrowed from the tuple, alive during the create call */
    ts[i].data = (const float *)b->buf;
    ts[i].ndim = b->ndim;
    ts[i].shape[0] = b->shape[0];
    ts[i].shape[1] = b->ndim == 2 ? b->shape[1] : 0;
  }
  {
    calrt_calbin *cb = NULL;
    calrt_status st;
    char msg[256];
    Py_BEGIN_ALLOW_THREADS st = calrt_calbin_create(self->dev, chip, &m, n ? ts : NULL, (size_t)n, &p, &t, &cb);
    if (st == CALRT_OK) {
      st = kv_owner ? p_sharekv(cb, kv_owner) : CALRT_OK;
      if (st == CALRT_OK) st = calrt_calbin_configure(cb);
      if (st != CALRT_OK) {
        snprintf(msg, sizeof msg, "%s", calrt_last_error());
        calrt_calbin_destroy(cb);
        cb = NULL;
      }
    } else {
      snprintf(msg, sizeof msg, "%s", calrt_last_error());
    }
    Py_END_ALLOW_THREADS if (st != CALRT_OK) {
      raise_code(st, msg);
      goto fail;
    }
    cbo->cb = cb;
    calrt_calbin_info info;
    calrt_calbin_info_get(cb, &info);
    cbo->id = info.calbin_id;
    cbo->lanes = info.profile.compiled_batch;
    cbo->kv_bf16 = info.profile.kv_dtype == CALRT_KV_BF16;
    memcpy(cbo->kv_shape, info.kv_shape, sizeof cbo->kv_shape);
  }
  Py_INCREF(self);
  cbo->owner = self;
  PyMem_Free(ts);
  Py_DECREF(seq);
  return (PyObject *)cbo;
fail:
  PyMem_Free(ts);
  Py_DECREF(seq);
  Py_DECREF(cbo);
  return NULL;
}

static PyMethodDef Device_methods[] = {
    {"close", (PyCFunction)Device_close, METH_NOARGS, "Close the device (no calbins may remain)."},
    {"capabilities", (PyCFunction)Device_capabilities, METH_NOARGS, "Runtime profile and capability flags."},
    {"dram", (PyCFunction)Device_dram, METH_VARARGS, "dram(chip) -> (capacity, used)."},
    {"reset", (PyCFunction)Device_reset, METH_VARARGS, "reset(chip); -1 = all chips."},
    {"faulted", (PyCFunction)Device_faulted, METH_VARARGS, "faulted(chip) -> bool."},
    {"needs_reconfigure", (PyCFunction)Device_needs_reconfigure, METH_VARARGS, "needs_reconfigure(chip)."},
    {"counters", (PyCFunction)Device_counters, METH_VARARGS, "counters(chip, engine) -> 6-tuple."},
    {"inject_fault", (PyCFunction)Device_inject_fault, METH_VARARGS, "Sim only."},
    {"completion_fd", (PyCFunction)Device_completion_fd, METH_VARARGS,
     "completion_fd(chip, engine) -> eventfd incremented per completed job (runtime-owned)."},
    {"load_calbin", (PyCFunction)Device_load_calbin, METH_VARARGS, "Create + configure a calbin."},
    {NULL}};

/* ------------------------------------------------------------------ Calbin */
#define NEED_CB(self)                                                                        \
  if (!(self)->cb || !(self)->owner || !(self)->owner->dev)                                 \
  return raise_code(CALRT_E_CLOSED, "the calbin was released")

static void Calbin_dealloc(CalbinObject *self) {
  if (self->cb) {
    if (calrt_calbin_destroy(self->cb) == CALRT_OK) {
      self->cb = NULL;
      release_bufs(self);
    } else {
      /* Jobs still in flight read these weights: leak the views rather than free under them. */
      self->bufs = NULL;
    }
  } else {
    release_bufs(self);
  }
  Py_XDECREF(self->owner);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Calbin_release(CalbinObject *self, PyObject *noargs) {
  if (self->cb) {
    CALL(calrt_calbin_destroy(self->cb));
    self->cb = NULL;
    release_bufs(self);
  }
  Py_RETURN_NONE;
}

static PyObject *Calbin_reconfigure(CalbinObject *self, PyObject *noargs) {
  NEED_CB(self);
  CALL(calrt_calbin_configure(self->cb));
  Py_RETURN_NONE;
}

static PyObject *Calbin_needs_reconfigure(CalbinObject *self, PyObject *noargs) {
  NEED_CB(self);
  calrt_calbin_info i;
  CALL(calrt_calbin_info_get(self->cb, &i));
  return PyBool_FromLong(i.needs_reconfigure);
}

static PyObject *Calbin_introspect(CalbinObject *self, PyObject *noargs) {
  NEED_CB(self);
  calrt_calbin_info i;
  CALL(calrt_calbin_info_get(self->cb, &i));
  PyObject *tl = PyList_New(0);
  if (!tl) return NULL;
  for (int32_t k = 0; k < i.num_tensors; k++) {
    calrt_tensor_info t;
    if (calrt_calbin_tensor_info(self->cb, k, &t) != CALRT_OK) break;
    PyObject *shape = t.ndim == 2 ? Py_BuildValue("(LL)", (long long)t.shape[0], (long long)t.shape[1])
                                  : Py_BuildValue("(L)", (long long)t.shape[0]);
    PyObject *e = Py_BuildValue("(sNs)", t.name, shape, t.dtype);
    if (!e || PyList_Append(tl, e) < 0) {
      Py_XDECREF(e);
      Py_DECREF(tl);
      return NULL;
    }
    Py_DECREF(e);
  }
  const calrt_model_desc *m = &i.model;
  const char *arch = m->arch == CALRT_ARCH_LLAMA    ? "LlamaForCausalLM"
                     : m->arch == CALRT_ARCH_QWEN2  ? "Qwen2ForCausalLM"
                     : m->arch == CALRT_ARCH_GEMMA3 ? "Gemma3ForCausalLM"
                     : m->arch == CALRT_ARCH_GEMMA2 ? "Gemma2ForCausalLM"
                                                    : "Qwen3ForCausalLM";
  PyObject *d = Py_BuildValue(
      "{s:i,s:i,s:{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:d,s:d,s:O,s:s,s:i,s:i,s:d,s:d,s:d,s:d,s:d},s:N,s:i,s:i,s:i,s:s,"
      "s:{s:s,s:(iiiii),s:s,s:K},s:O,s:O,s:O,s:s,s:K,s:O,s:O,s:O}",
      "calbin_id", i.calbin_id, "chip", i.chip, "model", "vocab_size", m->vocab_size, "hidden_size",
      m->hidden_size, "intermediate_size", m->intermediate_size, "num_hidden_layers", m->num_hidden_layers,
      "num_attention_heads", m->num_attention_heads, "num_key_value_heads", m->num_key_value_heads,
      "head_dim", m->head_dim, "rms_norm_eps", (double)m->rms_norm_eps, "rope_theta", m->rope_theta,
      "tie_word_embeddings", m->tie_word_embeddings ? Py_True : Py_False, "architecture",
      arch, "sliding_window", m->sliding_window, "sliding_window_pattern", m->sliding_window_pattern,
      "rope_local_theta", m->rope_local_theta, "query_pre_attn_scalar", (double)m->query_pre_attn_scalar,
      "rope_scaling_factor", (double)m->rope_scaling_factor, "attn_logit_softcapping",
      (double)m->attn_logit_softcapping, "final_logit_softcapping", (double)m->final_logit_softcapping,
      "tensors", tl, "compiled_batch",
      i.profile.compiled_batch, "max_seq", i.profile.max_seq, "max_sequences", i.profile.max_sequences,
      "kv_dtype", i.profile.kv_dtype == CALRT_KV_BF16 ? "bf16" : "fp32", "kv_layout", "order",
      "layer,kv,kv_head,position,head_dim", "shape_per_sequence", i.kv_shape[0], i.kv_shape[1],
      i.kv_shape[2], i.kv_shape[3], i.kv_shape[4], "dtype",
      i.profile.kv_dtype == CALRT_KV_BF16 ? "bf16" : "fp32", "bytes_per_token",
      (unsigned long long)i.kv_bytes_per_token, "valid_mask", i.profile.valid_mask ? Py_True : Py_False,
      "inactive_logits", i.profile.inactive_logits ? Py_True : Py_False, "inactive_writes_kv",
      i.inactive_writes_kv ? Py_True : Py_False, "exact_submodel", "decoder", "dram_bytes",
      (unsigned long long)i.dram_bytes, "configured", i.configured ? Py_True : Py_False, "needs_reconfigure",
      i.needs_reconfigure ? Py_True : Py_False, "null_compute", i.null_compute ? Py_True : Py_False);
  if (!d) return NULL;
  PyObject *g = Py_BuildValue("{s:i,s:i,s:K}", "kv_group", i.kv_group_id, "kv_group_size", i.kv_group_size,
                              "shared_dram_bytes", (unsigned long long)i.shared_dram_bytes);
  if (!g || PyDict_Update(d, g) < 0) {
    Py_XDECREF(g);
    Py_DECREF(d);
    return NULL;
  }
  Py_DECREF(g);
  return d;
}

static PyObject *Calbin_can_allocate(CalbinObject *self, PyObject *args) {
  int n, ok = 0;
  if (!PyArg_ParseTuple(args, "i", &n)) return NULL;
  NEED_CB(self);
  CALL(calrt_kv_can_allocate(self->cb, n, &ok));
  return PyBool_FromLong(ok);
}

static PyObject *Calbin_create_sequence(CalbinObject *self, PyObject *noargs) {
  NEED_CB(self);
  int32_t id = -1;
  CALL(calrt_kv_create_sequence(self->cb, &id));
  return PyLong_FromLong(id);
}

static PyObject *Calbin_free_sequence(CalbinObject *self, PyObject *args) {
  int s;
  if (!PyArg_ParseTuple(args, "i", &s)) return NULL;
  NEED_CB(self);
  CALL(calrt_kv_free_sequence(self->cb, s));
  Py_RETURN_NONE;
}

static PyObject *Calbin_committed_len(CalbinObject *self, PyObject *args) {
  int s;
  int32_t len = 0;
  if (!PyArg_ParseTuple(args, "i", &s)) return NULL;
  NEED_CB(self);
  CALL(calrt_kv_committed_len(self->cb, s, &len));
  return PyLong_FromLong(len);
}

static PyObject *Calbin_sequence_valid(CalbinObject *self, PyObject *args) {
  int s, v = 0;
  if (!PyArg_ParseTuple(args, "i", &s)) return NULL;
  NEED_CB(self);
  CALL(calrt_kv_sequence_valid(self->cb, s, &v));
  return PyBool_FromLong(v);
}

static PyObject *Calbin_remove_tokens_at_end(CalbinObject *self, PyObject *args) {
  int s, n;
  if (!PyArg_ParseTuple(args, "ii", &s, &n)) return NULL;
  NEED_CB(self);
  CALL(calrt_kv_remove_tokens_at_end(self->cb, s, n));
  Py_RETURN_NONE;
}

static PyObject *Calbin_do_shift(CalbinObject *self, PyObject *args) {
  int s, n;
  if (!PyArg_ParseTuple(args, "ii", &s, &n)) return NULL;
  NEED_CB(self);
  CALL(calrt_kv_do_shift(self->cb, s, n));
  Py_RETURN_NONE;
}

/* unsupported(name): call the matching (always NOT_SUPPORTED in 0.7.6) KvManager entry point. */
static PyObject *Calbin_unsupported(CalbinObject *self, PyObject *args) {
  const char *what;
  if (!PyArg_ParseTuple(args, "s", &what)) return NULL;
  NEED_CB(self);
  size_t n = 0;
  calrt_calbin *cb = self->cb;
  if (!strcmp(what, "copy_prefix")) CALL(calrt_kv_copy_prefix(cb, 0, 0, 0));
  else if (!strcmp(what, "keep_one")) CALL(calrt_kv_keep_one(cb, 0));
  else if (!strcmp(what, "position_add")) CALL(calrt_kv_position_add(cb, 0, 0));
  else if (!strcmp(what, "position_div")) CALL(calrt_kv_position_div(cb, 0, 1));
  else if (!strcmp(what, "save_session")) CALL(calrt_kv_save_session(cb, 0, NULL, &n));
  else if (!strcmp(what, "load_session")) CALL(calrt_kv_load_session(cb, 0, NULL, 0));
  else return raise_code(CALRT_E_INVALID_ARGUMENT, "unknown KvManager operation");
  Py_RETURN_NONE;
}

static PyObject *Calbin_read_kv(CalbinObject *self, PyObject *args) {
  int s;
  if (!PyArg_ParseTuple(args, "i", &s)) return NULL;
  NEED_CB(self);
  if (!p_readkv) return not_supported("read_kv");
  npy_intp dims[5];
  for (int i = 0; i < 5; i++) dims[i] = self->kv_shape[i];
  PyObject *arr = PyArray_SimpleNew(5, dims, self->kv_bf16 ? NPY_UINT16 : NPY_FLOAT32);
  if (!arr) return NULL;
  size_t n = (size_t)PyArray_NBYTES((PyArrayObject *)arr);
  void *buf = PyArray_DATA((PyArrayObject *)arr);
  calrt_status st;
  char msg[256];
  Py_BEGIN_ALLOW_THREADS st = p_readkv(self->cb, s, buf, &n);
  snprintf(msg, sizeof msg, "%s", calrt_last_error());
  Py_END_ALLOW_THREADS if (st) {
    Py_DECREF(arr);
    return raise_code(st, msg);
  }
  return arr;
}

static int as_i32(PyObject *o, Py_buffer *b, Py_ssize_t n, const char *what) {
  if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return -1;
  const char *f = b->format ? b->format : "B";
  int ok = (n < 0 || b->len / b->itemsize == n) &&
           ((b->itemsize == 4 && (!strcmp(f, "i") || !strcmp(f, "=i") || !strcmp(f, "<i") || !strcmp(f, "l"))) ||
            (b->itemsize == 1 && (!strcmp(f, "B") || !strcmp(f, "?") || !strcmp(f, "b"))));
  if (!ok) {
    PyBuffer_Release(b);
    PyErr_Format(PyExc_TypeError, "%s: wrong dtype/length", what);
    return -1;
  }
  return 0;
}

/* The Job object of a submitted runtime job, or of a host-driven run (one of the two). On failure the
 * caller's reference goes: a job completes and frees itself (the engine holds its own reference); a
 * run's step in flight is released and no further step is submitted (nobody would drive it). */
static PyObject *job_object(CalbinObject *self, calrt_job *job, hs_run *run) {
  JobObject *jo = PyObject_New(JobObject, &JobType);
  if (!jo) {
    if (job) calrt_job_release(job);
    if (run) hs_free(run);
    return NULL;
  }
  jo->job = job;
  jo->run = run;
  jo->id = job ? calrt_job_id(job) : hs_id(run);
  Py_INCREF(self);
  jo->calbin = (PyObject *)self;
  return (PyObject *)jo;
}

static PyObject *submit_job(CalbinObject *self, calrt_job *job, int engine) {
  calrt_status st;
  char msg[256];
  Py_BEGIN_ALLOW_THREADS st = calrt_job_submit(job, (calrt_engine)engine);
  snprintf(msg, sizeof msg, "%s", calrt_last_error());
  Py_END_ALLOW_THREADS if (st) {
    calrt_job_release(job);
    return raise_code(st, msg);
  }
  return job_object(self, job, NULL);
}

/* submit_prefill(seq, tokens, engine) / submit_prefill_all(seq, tokens, engine): create (GIL released:
 * it copies the tokens and, for prefill_all, allocates n * vocab floats of output) + submit. */
static PyObject *submit_prefill(CalbinObject *self, PyObject *args, int all) {
  int seq, engine;
  PyObject *tok;
  if (!PyArg_ParseTuple(args, "iOi", &seq, &tok, &engine)) return NULL;
  NEED_CB(self);
  if (all && !p_prefill_all)
    return raise_code(CALRT_E_NOT_SUPPORTED, "submit_prefill_all: prompt logits (calrt_job_create_prefill_all, "
                      "C3) are not provided by this runtime build");
  Py_buffer b;
  if (as_i32(tok, &b, -1, "tokens") < 0) return NULL;
  calrt_job *job = NULL;
  calrt_status st;
  char msg[256];
  const int32_t n = (int32_t)(b.len / 4);
  Py_BEGIN_ALLOW_THREADS st = all ? p_prefill_all(self->cb, seq, (const int32_t *)b.buf, n, &job)
                                  : calrt_job_create_prefill(self->cb, seq, (const int32_t *)b.buf, n, &job);
  snprintf(msg, sizeof msg, "%s", calrt_last_error());
  Py_END_ALLOW_THREADS PyBuffer_Release(&b);
  if (st) return raise_code(st, msg);
  return submit_job(self, job, engine);
}

static PyObject *Calbin_submit_prefill(CalbinObject *self, PyObject *args) { return submit_prefill(self, args, 0); }
static PyObject *Calbin_submit_prefill_all(CalbinObject *self, PyObject *args) {
  return submit_prefill(self, args, 1);
}

/* The inputs of a decode submit: seq_ids, tokens, positions (int32), valid (uint8) and lane_steps
 * (int32, or None), each compiled_batch entries, as C buffers (release with decode_in_release). */
typedef struct {
  Py_buffer b[5]; /* seq_ids, tokens, positions, valid, lane_steps */
  int n;          /* buffers held */
} decode_in;

static void decode_in_release(decode_in *in) {
  for (int i = 0; i < in->n; i++) PyBuffer_Release(&in->b[i]);
  in->n = 0;
}

static int decode_in_get(CalbinObject *self, PyObject *const o[5], decode_in *in) {
  static const char *names[5] = {"seq_ids", "tokens", "positions", "valid", "lane_steps"};
  in->n = 0;
  for (int i = 0; i < 5; i++) {
    if (i == 4 && o[4] == Py_None) break;
    if (as_i32(o[i], &in->b[i], self->lanes, names[i]) < 0) {
      decode_in_release(in);
      return -1;
    }
    in->n++;
    if (in->b[i].itemsize != (i == 3 ? 1 : 4)) {
      decode_in_release(in);
      PyErr_Format(PyExc_TypeError, "%s: wrong dtype/length", names[i]);
      return -1;
    }
  }
  return 0;
}

#define DECODE_ARGS(in) (in).b[0].buf, (in).b[1].buf, (in).b[2].buf, (in).b[3].buf
#define LANE_STEPS(in) ((in).n == 5 ? (const int32_t *)(in).b[4].buf : NULL)

/* submit_decode(seq_ids, tokens, positions, valid, engine[, steps[, lane_steps]]): steps > 1 is a
 * multi-step greedy decode (calrt_job_create_decode_steps, C3-style), lane_steps (int32 per lane, or
 * None: every lane `steps`) its lanes' own step counts. */
static PyObject *Calbin_submit_decode(CalbinObject *self, PyObject *args) {
  PyObject *o[5] = {NULL, NULL, NULL, NULL, Py_None};
  int engine, steps = 1;
  if (!PyArg_ParseTuple(args, "OOOOi|iO", &o[0], &o[1], &o[2], &o[3], &engine, &steps, &o[4])) return NULL;
  NEED_CB(self);
  if (steps != 1 && !p_decode_steps)
    return raise_code(CALRT_E_NOT_SUPPORTED, "submit_decode: multi-step decode (calrt_job_create_decode_steps, "
                      "C3) is not provided by this runtime build");
  decode_in in;
  if (decode_in_get(self, o, &in) < 0) return NULL;
  calrt_job *job = NULL;
  calrt_status st;
  char msg[256];
  Py_BEGIN_ALLOW_THREADS st = steps == 1 ? calrt_job_create_decode(self->cb, DECODE_ARGS(in), self->lanes, &job)
                                         : p_decode_steps(self->cb, DECODE_ARGS(in), self->lanes, steps,
                                                          LANE_STEPS(in), &job);
  snprintf(msg, sizeof msg, "%s", calrt_last_error());
  Py_END_ALLOW_THREADS decode_in_release(&in);
  if (st) return raise_code(st, msg);
  return submit_job(self, job, engine);
}

/* submit_decode_host(seq_ids, tokens, positions, valid, engine, steps[, lane_steps[, end_off, end_ids,
 * end_from]]): a multi-step greedy decode driven by the host (host_steps.h): `steps` one-step jobs back
 * to back on `engine`, each lane's argmax fed back in C by the thread that waits. Any runtime: calrt.h's
 * core API only. end_off (int32, lanes + 1), end_ids (int32) and end_from (int32, lanes, or None): each
 * lane's end tokens (hs_start_ends). */
static PyObject *Calbin_submit_decode_host(CalbinObject *self, PyObject *args) {
  PyObject *o[5] = {NULL, NULL, NULL, NULL, Py_None}, *eo = Py_None, *ei = Py_None, *ef = Py_None;
  int engine, steps;
  if (!PyArg_ParseTuple(args, "OOOOii|OOOO", &o[0], &o[1], &o[2], &o[3], &engine, &steps, &o[4], &eo, &ei, &ef))
    return NULL;
  NEED_CB(self);
  if (steps < 1 || steps > CALRT_MAX_DECODE_STEPS)
    return raise_code(CALRT_E_INVALID_ARGUMENT, "steps: must be in [1, CALRT_MAX_DECODE_STEPS]");
  if (engine != CALRT_ENGINE_PING && engine != CALRT_ENGINE_PONG)
    return raise_code(CALRT_E_INVALID_ARGUMENT, "engine: not PING(0) or PONG(1)");
  decode_in in;
  if (decode_in_get(self, o, &in) < 0) return NULL;
  const int32_t *ls = LANE_STEPS(in);
  for (Py_ssize_t l = 0; ls && l < self->lanes; l++) /* hs_start's own check, here with a message */
    if (((const uint8_t *)in.b[3].buf)[l] && (ls[l] < 1 || ls[l] > steps)) {
      decode_in_release(&in);
      return raise_code(CALRT_E_INVALID_ARGUMENT, "lane_steps: each valid lane's must be in [1, steps]");
    }
  Py_buffer eb[3];
  int held = 0;
  if (eo != Py_None) { /* end_off [lanes + 1], end_ids [any], end_from [lanes] or None */
    if (ei == Py_None || as_i32(eo, &eb[0], self->lanes + 1, "end_off") < 0) goto bad_ends;
    held = 1;
    if (as_i32(ei, &eb[1], -1, "end_ids") < 0) goto bad_ends;
    held = 2;
    if (ef != Py_None) {
      if (as_i32(ef, &eb[2], self->lanes, "end_from") < 0) goto bad_ends;
      held = 3;
    }
    int ok = eb[0].itemsize == 4 && eb[1].itemsize == 4 && (held < 3 || eb[2].itemsize == 4);
    const int32_t *off = eb[0].buf;
    ok = ok && off[0] == 0 && (Py_ssize_t)off[self->lanes] <= eb[1].len / 4;
    for (Py_ssize_t l = 0; ok && l < self->lanes; l++) ok = off[l + 1] >= off[l];
    for (Py_ssize_t l = 0; ok && held == 3 && l < self->lanes; l++) ok = ((const int32_t *)eb[2].buf)[l] >= 0;
    if (!ok) {
      PyErr_SetString(PyExc_ValueError, "end_off/end_ids/end_from: int32 offsets from 0, non-decreasing, within "
                      "end_ids; end_from >= 0");
      goto bad_ends;
    }
  }
  hs_run *run = NULL;
  calrt_status st;
  char msg[256];
  const int32_t *e_off = held ? eb[0].buf : NULL, *e_ids = held ? eb[1].buf : NULL,
                *e_from = held == 3 ? eb[2].buf : NULL;
  Py_BEGIN_ALLOW_THREADS st = hs_start_ends(self->cb, (calrt_engine)engine, DECODE_ARGS(in), self->lanes, steps, ls,
                                            e_off, e_ids, e_from, &run);
  snprintf(msg, sizeof msg, "%s", calrt_last_error());
  Py_END_ALLOW_THREADS decode_in_release(&in);
  for (int i = 0; i < held; i++) PyBuffer_Release(&eb[i]);
  if (st) return raise_code(st, msg);
  return job_object(self, NULL, run);
bad_ends:
  for (int i = 0; i < held; i++) PyBuffer_Release(&eb[i]);
  decode_in_release(&in);
  if (eo != Py_None && ei == Py_None) PyErr_SetString(PyExc_ValueError, "end_off without end_ids");
  return NULL;
}

static PyObject *Calbin_get_id(CalbinObject *self, void *c) { return PyLong_FromLong(self->id); }

static PyGetSetDef Calbin_getset[] = {{"calbin_id", (getter)Calbin_get_id, NULL, "calbin id", NULL}, {NULL}};

static PyMethodDef Calbin_methods[] = {
    {"release", (PyCFunction)Calbin_release, METH_NOARGS, "ResetConfiguration + destroy."},
    {"reconfigure", (PyCFunction)Calbin_reconfigure, METH_NOARGS, "Configure again."},
    {"needs_reconfigure", (PyCFunction)Calbin_needs_reconfigure, METH_NOARGS, ""},
    {"introspect", (PyCFunction)Calbin_introspect, METH_NOARGS, "Calbin description dict."},
    {"can_allocate", (PyCFunction)Calbin_can_allocate, METH_VARARGS, ""},
    {"create_sequence", (PyCFunction)Calbin_create_sequence, METH_NOARGS, ""},
    {"free_sequence", (PyCFunction)Calbin_free_sequence, METH_VARARGS, ""},
    {"committed_len", (PyCFunction)Calbin_committed_len, METH_VARARGS, ""},
    {"sequence_valid", (PyCFunction)Calbin_sequence_valid, METH_VARARGS, ""},
    {"remove_tokens_at_end", (PyCFunction)Calbin_remove_tokens_at_end, METH_VARARGS, ""},
    {"do_shift", (PyCFunction)Calbin_do_shift, METH_VARARGS, ""},
    {"unsupported", (PyCFunction)Calbin_unsupported, METH_VARARGS, ""},
    {"read_kv", (PyCFunction)Calbin_read_kv, METH_VARARGS, "Sim only."},
    {"submit_prefill", (PyCFunction)Calbin_submit_prefill, METH_VARARGS, ""},
    {"submit_prefill_all", (PyCFunction)Calbin_submit_prefill_all, METH_VARARGS,
     "submit_prefill_all(seq, tokens, engine): a prefill returning every position's logits (C3-style)."},
    {"submit_decode", (PyCFunction)Calbin_submit_decode, METH_VARARGS, ""},
    {"submit_decode_host", (PyCFunction)Calbin_submit_decode_host, METH_VARARGS,
     "submit_decode_host(seq_ids, tokens, positions, valid, engine, steps[, lane_steps[, end_off, end_ids, "
     "end_from]]): host-driven multi-step."},
    {NULL}};

/* ------------------------------------------------------------------ Job */
static void Job_dealloc(JobObject *self) {
  if (self->job) calrt_job_release(self->job);
  if (self->run) hs_free(self->run);
  Py_XDECREF(self->calbin);
  Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *view(JobObject *self, int nd, npy_intp *dims, int type, const void *data) {
  PyObject *a = PyArray_SimpleNewFromData(nd, dims, type, (void *)data);
  if (!a) return NULL;
  Py_INCREF(self);
  if (PyArray_SetBaseObject((PyArrayObject *)a, (PyObject *)self) < 0) {
    Py_DECREF(a);
    return NULL;
  }
  return a;
}

/* wait(timeout_us) -> (status, logits, echo, checksum, device_us); outputs are zero-copy views. */
static PyObject *Job_wait(JobObject *self, PyObject *args) {
  long long timeout;
  if (!PyArg_ParseTuple(args, "L", &timeout)) return NULL;
  calrt_job_status js;
  calrt_job_result r;
  if (self->run) {
    calrt_status st;
    Py_BEGIN_ALLOW_THREADS st = hs_wait(self->run, timeout, &js);
    Py_END_ALLOW_THREADS if (st != CALRT_OK) return raise_code(st, "wait timed out (host-driven multi-step decode)");
    st = hs_result(self->run, &r, NULL);
    if (st != CALRT_OK) return raise_code(st, "host-driven multi-step decode: no result");
  } else {
    CALL(calrt_job_wait(self->job, timeout, &js));
    CALL(calrt_job_result_get(self->job, &r));
  }
  npy_intp d2[2] = {r.lanes, r.vocab}, d3[2] = {r.lanes, 3}, d1[1] = {r.lanes};
  PyObject *lg = view(self, 2, d2, NPY_FLOAT32, r.logits);
  PyObject *ec = view(self, 2, d3, NPY_INT64, r.echo);
  PyObject *ck = view(self, 1, d1, NPY_UINT64, r.checksum);
  if (!lg || !ec || !ck) {
    Py_XDECREF(lg); Py_XDECREF(ec); Py_XDECREF(ck);
    return NULL;
  }
  return Py_BuildValue("(iNNNd)", (int)r.status, lg, ec, ck, r.device_us);
}

/* step_tokens() -> int32 [lanes, steps] view of a completed multi-step decode's tokens. */
static PyObject *Job_step_tokens(JobObject *self, PyObject *noargs) {
  if (self->run) {
    calrt_job_result r;
    const int32_t *t = NULL;
    if (hs_result(self->run, &r, &t) != CALRT_OK)
      return raise_code(CALRT_E_INVALID_ARGUMENT, "step_tokens: the run has not finished");
    npy_intp d[2] = {r.lanes, (npy_intp)hs_steps_run(self->run)}; /* fewer once stopped early */
    return view(self, 2, d, NPY_INT32, t);
  }
  if (!p_step_tokens) return raise_code(CALRT_E_NOT_SUPPORTED, "step_tokens: not provided by this runtime build");
  const int32_t *t = NULL;
  int32_t steps = 0;
  calrt_job_result r;
  /* both only read a completed job's fields (no wait): no GIL hand-over */
  calrt_status st = p_step_tokens(self->job, &t, &steps);
  if (st == CALRT_OK) st = calrt_job_result_get(self->job, &r);
  if (st != CALRT_OK) return raise_code(st, calrt_last_error());
  npy_intp d[2] = {r.lanes, steps};
  return view(self, 2, d, NPY_INT32, t);
}

/* A host-driven run advances here too (never blocking), so a caller polling done() sees it through. */
static PyObject *Job_done(JobObject *self, PyObject *noargs) {
  if (self->run) return PyBool_FromLong(hs_poll(self->run));
  return PyBool_FromLong(calrt_job_done(self->job));
}

/* Steps a host-driven run submitted so far (1 for any other job). */
static PyObject *Job_submitted(JobObject *self, PyObject *noargs) {
  return PyLong_FromLong(self->run ? hs_submitted(self->run) : 1);
}
/* A host-driven run ends with the step in flight (hs_stop; never blocks); any other job: no effect
 * (a device job cannot be cut short). True when the job is a host-driven run. */
static PyObject *Job_stop(JobObject *self, PyObject *noargs) {
  if (self->run) hs_stop(self->run);
  return PyBool_FromLong(self->run != NULL);
}
/* lane_steps() -> None, or int32 [lanes] (a copy): each lane's steps run, when a host-driven run ended
 * a lane short of its steps (an end token, stop()); None for any other job or outcome. */
static PyObject *Job_lane_steps(JobObject *self, PyObject *noargs) {
  if (!self->run || !hs_short(self->run)) Py_RETURN_NONE;
  npy_intp d[1] = {0};
  calrt_job_result r;
  if (hs_result(self->run, &r, NULL) != CALRT_OK) Py_RETURN_NONE;
  d[0] = r.lanes;
  PyObject *a = PyArray_SimpleNew(1, d, NPY_INT32);
  if (a) memcpy(PyArray_DATA((PyArrayObject *)a), hs_lane_steps(self->run), sizeof(int32_t) * (size_t)r.lanes);
  return a;
}
static PyObject *Job_get_id(JobObject *self, void *c) { return PyLong_FromLongLong(self->id); }

static PyMethodDef Job_methods[] = {
    {"wait", (PyCFunction)Job_wait, METH_VARARGS, "wait(timeout_us) (GIL released)."},
    {"done", (PyCFunction)Job_done, METH_NOARGS, ""},
    {"submitted", (PyCFunction)Job_submitted, METH_NOARGS, "Device jobs submitted (a host-driven run: its steps so far)."},
    {"step_tokens", (PyCFunction)Job_step_tokens, METH_NOARGS, "A multi-step decode's tokens [lanes, steps]."},
    {"stop", (PyCFunction)Job_stop, METH_NOARGS, "End a host-driven run with its step in flight."},
    {"lane_steps", (PyCFunction)Job_lane_steps, METH_NOARGS,
     "A host-driven run's steps per lane when a lane ran short (end token, stop); else None."},
    {NULL}};
static PyGetSetDef Job_getset[] = {{"job_id", (getter)Job_get_id, NULL, "job id", NULL}, {NULL}};

/* ------------------------------------------------------------------ module */
/* Hashing under the GIL is cheaper than a GIL hand-over below this size (the whole row of a small
 * vocabulary hashes in about a microsecond). */
#define CHECKSUM_NOGIL_BYTES (256 * 1024)

static PyObject *mod_checksum(PyObject *m, PyObject *arg) {
  Py_buffer b;
  if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) < 0) return NULL;
  uint64_t h;
  if (b.len >= CHECKSUM_NOGIL_BYTES) {
    Py_BEGIN_ALLOW_THREADS h = calrt_checksum(b.buf, (size_t)b.len);
    Py_END_ALLOW_THREADS
  } else {
    h = calrt_checksum(b.buf, (size_t)b.len);
  }
  PyBuffer_Release(&b);
  return PyLong_FromUnsignedLongLong(h);
}

/* bad_rows(logits[rows, V] float32 C-contiguous, checksums[rows] uint64, lanes) -> list of the lanes whose
 * row does not hash to its reported checksum: one call per job instead of one per lane. */
static PyObject *mod_bad_rows(PyObject *m, PyObject *args) {
  PyObject *lo, *co, *lanes;
  if (!PyArg_ParseTuple(args, "OOO", &lo, &co, &lanes)) return NULL;
  Py_buffer bl, bc;
  if (PyObject_GetBuffer(lo, &bl, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) return NULL;
  if (PyObject_GetBuffer(co, &bc, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) {
    PyBuffer_Release(&bl);
    return NULL;
  }
  PyObject *seq = PySequence_Fast(lanes, "lanes must be a sequence of ints");
  PyObject *bad = seq ? PyList_New(0) : NULL;
  Py_ssize_t rows = bc.len / 8;
  if (bad && (bl.ndim != 2 || bl.shape[0] != rows || bc.itemsize != 8 || bl.itemsize != 4)) {
    PyErr_SetString(PyExc_ValueError, "bad_rows: logits must be [rows, V] float32 and checksums [rows] uint64");
    Py_CLEAR(bad);
  }
  if (bad) {
    size_t row_bytes = (size_t)bl.shape[1] * 4;
    const uint64_t *sums = (const uint64_t *)bc.buf;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
      PyObject *it = PySequence_Fast_GET_ITEM(seq, i);
      Py_ssize_t lane = PyLong_AsSsize_t(it);
      if (lane == -1 && PyErr_Occurred()) { Py_CLEAR(bad); break; }
      if (lane < 0 || lane >= rows) {
        PyErr_Format(PyExc_IndexError, "bad_rows: lane %zd not in [0, %zd)", lane, rows);
        Py_CLEAR(bad);
        break;
      }
      const char *row = (const char *)bl.buf + (size_t)lane * row_bytes;
      if (calrt_checksum(row, row_bytes) != sums[lane] && PyList_Append(bad, it) < 0) { Py_CLEAR(bad); break; }
    }
  }
  Py_XDECREF(seq);
  PyBuffer_Release(&bl);
  PyBuffer_Release(&bc);
  return bad;
}

/* verify_lanes(logits[rows, V] f32, checksums[rows] u64, echo[rows, 3] i64, job_id, lanes, expect) -> list of
 * the positions k (into `lanes`) whose lane lanes[k] does not echo (job_id, expect[k][0], expect[k][1]) or
 * whose row does not hash to its checksum. The dispatcher's whole per-job output check in one call. */
static PyObject *mod_verify_lanes(PyObject *m, PyObject *args) {
  PyObject *lo, *co, *eo, *lanes, *expect;
  long long jid;
  if (!PyArg_ParseTuple(args, "OOOLOO", &lo, &co, &eo, &jid, &lanes, &expect)) return NULL;
  Py_buffer bl, bc, be;
  if (PyObject_GetBuffer(lo, &bl, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) return NULL;
  if (PyObject_GetBuffer(co, &bc, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) {
    PyBuffer_Release(&bl);
    return NULL;
  }
  if (PyObject_GetBuffer(eo, &be, PyBUF_C_CONTIGUOUS | PyBUF_ND) < 0) {
    PyBuffer_Release(&bl);
    PyBuffer_Release(&bc);
    return NULL;
  }
  PyObject *ls = PySequence_Fast(lanes, "lanes must be a sequence of ints");
  PyObject *es = ls ? PySequence_Fast(expect, "expect must be a sequence of (seq_id, position)") : NULL;
  PyObject *bad = es ? PyList_New(0) : NULL;
  Py_ssize_t rows = bc.len / 8;
  if (bad && (bl.ndim != 2 || bl.shape[0] != rows || bc.itemsize != 8 || bl.itemsize != 4 || be.ndim != 2 ||
              be.shape[0] != rows || be.shape[1] != 3 || be.itemsize != 8)) {
    PyErr_SetString(PyExc_ValueError, "verify_lanes: logits [rows, V] f32, checksums [rows] u64, echo [rows, 3] i64");
    Py_CLEAR(bad);
  }
  if (bad && PySequence_Fast_GET_SIZE(ls) != PySequence_Fast_GET_SIZE(es)) {
    PyErr_SetString(PyExc_ValueError, "verify_lanes: lanes and expect differ in length");
    Py_CLEAR(bad);
  }
  if (bad) {
    size_t row_bytes = (size_t)bl.shape[1] * 4;
    const uint64_t *sums = (const uint64_t *)bc.buf;
    const int64_t *echo = (const int64_t *)be.buf;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ls);
    for (Py_ssize_t k = 0; k < n; k++) {
      Py_ssize_t lane = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(ls, k));
      long long want_seq = 0, want_pos = 0;
      PyObject *pair = PySequence_Fast_GET_ITEM(es, k);
      if (lane == -1 && PyErr_Occurred()) { Py_CLEAR(bad); break; }
      if (!PyArg_ParseTuple(pair, "LL", &want_seq, &want_pos)) { Py_CLEAR(bad); break; }
      if (lane < 0 || lane >= rows) {
        PyErr_Format(PyExc_IndexError, "verify_lanes: lane %zd not in [0, %zd)", lane, rows);
        Py_CLEAR(bad);
        break;
      }
      const int64_t *e = echo + 3 * lane;
      const char *row = (const char *)bl.buf + (size_t)lane * row_bytes;
      int ok = e[0] == jid && e[1] == want_seq && e[2] == want_pos && calrt_checksum(row, row_bytes) == sums[lane];
      if (!ok) {
        PyObject *kk = PyLong_FromSsize_t(k);
        if (!kk || PyList_Append(bad, kk) < 0) { Py_XDECREF(kk); Py_CLEAR(bad); break; }
        Py_DECREF(kk);
      }
    }
  }
  Py_XDECREF(es);
  Py_XDECREF(ls);
  PyBuffer_Release(&bl);
  PyBuffer_Release(&bc);
  PyBuffer_Release(&be);
  return bad;
}

static PyMethodDef mod_methods[] = {
    {"checksum", mod_checksum, METH_O, "calrt_checksum of a contiguous buffer (the device's lane checksum)."},
    {"verify_lanes", mod_verify_lanes, METH_VARARGS,
     "verify_lanes(logits, checksums, echo, job_id, lanes, expect) -> indices k whose echo/checksum differ."},
    {"bad_rows", mod_bad_rows, METH_VARARGS, "bad_rows(logits, checksums, lanes) -> lanes whose checksum differs."},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "calserve._calrt",
                                    "Tiny CPython binding over calrt.h.", -1, mod_methods};

PyMODINIT_FUNC PyInit__calrt(void) {
  import_array();
  DeviceType = (PyTypeObject){PyVarObject_HEAD_INIT(NULL, 0).tp_name = "calserve._calrt.Device",
                              .tp_basicsize = sizeof(DeviceObject), .tp_flags = Py_TPFLAGS_DEFAULT,
                              .tp_new = PyType_GenericNew, .tp_init = (initproc)Device_init,
                              .tp_dealloc = (destructor)Device_dealloc, .tp_methods = Device_methods};
  CalbinType = (PyTypeObject){PyVarObject_HEAD_INIT(NULL, 0).tp_name = "calserve._calrt.Calbin",
                              .tp_basicsize = sizeof(CalbinObject), .tp_flags = Py_TPFLAGS_DEFAULT,
                              .tp_dealloc = (destructor)Calbin_dealloc, .tp_methods = Calbin_methods,
                              .tp_getset = Calbin_getset};
  JobType = (PyTypeObject){PyVarObject_HEAD_INIT(NULL, 0).tp_name = "calserve._calrt.Job",
                           .tp_basicsize = sizeof(JobObject), .tp_flags = Py_TPFLAGS_DEFAULT,
                           .tp_dealloc = (destructor)Job_dealloc, .tp_methods = Job_methods,
                           .tp_getset = Job_getset};
  if (PyType_Ready(&DeviceType) < 0 || PyType_Ready(&CalbinType) < 0 || PyType_Ready(&JobType) < 0)
    return NULL;
  PyObject *m = PyModule_Create(&moddef);
  if (!m) return NULL;
  Error = PyErr_NewException("calserve._calrt.Error", NULL, NULL);
  Py_INCREF(Error);
  PyModule_AddObject(m, "Error", Error);
  Py_INCREF(&DeviceType);
  PyModule_AddObject(m, "Device", (PyObject *)&DeviceType);
  Py_INCREF(&CalbinType);
  PyModule_AddObject(m, "Calbin", (PyObject *)&CalbinType);
  Py_INCREF(&JobType);
  PyModule_AddObject(m, "Job", (PyObject *)&JobType);
  PyModule_AddIntConstant(m, "QUEUE_DEPTH", CALRT_QUEUE_DEPTH);
  resolve_sim();
  return m;
}
