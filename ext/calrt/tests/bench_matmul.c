/* bench_matmul.c — the linear-layer kernel alone, one thread, on SmolLM2's decode shapes
 * (`make -C ext/calrt bench-matmul`): G multiply-adds per second streaming the weights from memory
 * (enough copies of each matrix to exceed the L3, on 2 MiB pages like the real weights), in chunks of
 * the size the pass hands to its tasks. Run it next to bench/runtime_bench.py: on a shared host the
 * kernel's own throughput swings with the load, and this tells the kernel's share of a slow pass
 * from the pass's (compare with the per-phase times of CALRT_SIM_PROFILE=1).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "internal.h"

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int by_value(const void *a, const void *b) {
  const double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

int main(void) {
  const struct {
    const char *name;
    int out, in, chunk;
  } shapes[] = {{"gate/up 1536x576", 1536, 576, 96}, {"down 576x1536", 576, 1536, 48},
                {"lm_head 49152x576", 49152, 576, 3072}};
  const int rows[] = {1, 4, 16};
  enum { REPS = 7 };
  const size_t budget = (size_t)256 << 20; /* bytes of weights per shape: well beyond the L3 */
  const sim_isa_id isa = sim_isa();
  printf("path %s, 1 thread, weights streamed from memory (2 MiB pages), median of %d passes\n",
         sim_isa_name(isa), REPS);
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    const size_t per = (size_t)shapes[s].out * (size_t)shapes[s].in;
    const size_t copies = budget / (per * sizeof(float)) > 0 ? budget / (per * sizeof(float)) : 1;
    const size_t bytes = ((per * copies * sizeof(float)) + ((size_t)2 << 20) - 1) & ~(((size_t)2 << 20) - 1);
    float *W = aligned_alloc((size_t)2 << 20, bytes);
    float *X = aligned_alloc(64, sizeof(float) * 16 * (size_t)shapes[s].in);
    float *Y = aligned_alloc(64, sizeof(float) * 16 * (size_t)shapes[s].out);
    if (!W || !X || !Y) return 1;
#ifdef MADV_HUGEPAGE
    madvise(W, bytes, MADV_HUGEPAGE);
#endif
    for (size_t i = 0; i < per * copies; i++) W[i] = (float)((i * 2654435761u) % 1000u) * 1e-3f - 0.5f;
    for (int i = 0; i < 16 * shapes[s].in; i++) X[i] = (float)(i % 97) * 1e-2f;
    for (size_t r = 0; r < sizeof rows / sizeof rows[0]; r++) {
      const int R = rows[r];
      double gs[REPS];
      for (int rep = 0; rep < REPS; rep++) {
        const double t0 = now_s();
        for (size_t c = 0; c < copies; c++)
          for (int o = 0; o < shapes[s].out; o += shapes[s].chunk)
            sim_matmul_range_isa(isa, W + c * per, shapes[s].out, shapes[s].in, X, R, Y, o,
                                 o + shapes[s].chunk < shapes[s].out ? o + shapes[s].chunk : shapes[s].out);
        gs[rep] = (double)per * (double)copies * R / (now_s() - t0) / 1e9;
      }
      qsort(gs, REPS, sizeof gs[0], by_value);
      printf("%-18s R=%-2d %6.1f G multiply-adds/s (%5.1f GB/s of weights; min %.1f, max %.1f)\n",
             shapes[s].name, R, gs[REPS / 2], gs[REPS / 2] * 4.0 / R, gs[0], gs[REPS - 1]);
    }
    free(W);
    free(X);
    free(Y);
  }
  return 0;
}
