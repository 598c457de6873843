/* faults.c — deterministic fault injection ("on the nth submit of engine X") and crosstalk. */
#include <string.h>

#include "internal.h"

/* Called with chip->mu held for every submit attempt that reached the engine. Every armed fault counts
 * down; the first one reaching zero hits this submit (others reaching zero are consumed too). */
int sim_fault_take(sim_engine *e, int32_t *lane) {
  int hit = -1;
  for (int i = 0; i < SIM_MAX_FAULTS; i++) {
    sim_fault *f = &e->faults[i];
    if (!f->armed) continue;
    if (--f->countdown == 0) {
      f->armed = 0;
      if (hit < 0) {
        hit = (int)f->kind;
        *lane = f->lane;
      }
    }
  }
  return hit;
}

/* Corrupt one lane's logits after its checksum was taken: copy a neighbour lane's row into it (the
 * mis-routing a crosstalk fault looks like) and, if that left the bytes equal, flip a mantissa bit. */
void sim_apply_crosstalk(calrt_job *job, int32_t lane) {
  int32_t l = lane % job->lanes;
  size_t v = (size_t)job->cb->m.vocab_size;
  float *row = job->logits + (size_t)l * v;
  if (job->lanes > 1) {
    int32_t src = (l + 1) % job->lanes;
    memcpy(row, job->logits + (size_t)src * v, v * sizeof(float));
  }
  if (calrt_checksum(row, v * sizeof(float)) == job->checksum[l]) {
    uint32_t u;
    memcpy(&u, row, 4);
    u ^= 1u;
    memcpy(row, &u, 4);
  }
}
