/* Every one of the 2^32 float inputs through each vector path of vexp.c this CPU runs against this
 * process's expf, bitwise (NaNs included: the special inputs go through expf itself); and, for the
 * record, glibc's plain (non-FMA) build of the algorithm in scalar C against the same expf. Not run by
 * CI (~1-2 min): `make exp-exhaustive`. Prints the mismatches per path (and the first few inputs). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "internal.h"

/* glibc 2.28+ sysdeps/ieee754/flt-32/e_expf.c's normal path, compiled with -ffp-contract=off. */
static float ref_plain(float x) {
  const double xd = x, z = (0x1.71547652b82fep+0 * 32) * xd;
  double kd = z + 0x1.8p+52;
  uint64_t ki;
  memcpy(&ki, &kd, 8);
  kd -= 0x1.8p+52;
  const double r = z - kd;
  uint64_t t = sim_vexp_tab[ki % 32] + (ki << 47);
  double s;
  memcpy(&s, &t, 8);
  const double zz = (0x1.c6af84b912394p-5 / 32 / 32 / 32) * r + (0x1.ebfce50fac4f3p-3 / 32 / 32);
  const double r2 = r * r;
  double y = (0x1.62e42ff0c52d6p-1 / 32) * r + 1;
  y = zz * r2 + y;
  return (float)(y * s);
}

int main(void) {
  enum { N = 1 << 16 };
  static float x[N], y[N];
  int bad_total = 0;
  printf("in use: %s\n", sim_vexp_name(sim_vexp_mode()));
  long long plain_bad = 0;
  for (int m = SIM_VEXP_AVX2; m < SIM_VEXP_COUNT; m++) {
    if (!sim_vexp_supported((sim_vexp_id)m)) {
      printf("%s: not available on this CPU\n", sim_vexp_name((sim_vexp_id)m));
      continue;
    }
    long long bad = 0;
    for (uint64_t base = 0; base < (1ULL << 32); base += N) {
      for (int i = 0; i < N; i++) {
        const uint32_t u = (uint32_t)(base + (uint64_t)i);
        memcpy(&x[i], &u, 4);
      }
      sim_vexp_n((sim_vexp_id)m, x, y, N);
      for (int i = 0; i < N; i++) {
        const float want = expf(x[i]);
        if (memcmp(&want, &y[i], 4) != 0 && bad++ < 4)
          printf("  %s: expf(%a) = %a, vector %a\n", sim_vexp_name((sim_vexp_id)m), x[i], want, y[i]);
        if (m == SIM_VEXP_AVX2 && fabsf(x[i]) < 88.0f) {
          const float r = ref_plain(x[i]);
          if (memcmp(&r, &want, 4) != 0 && plain_bad++ < 4)
            printf("  glibc's plain build: %a -> %a, expf %a\n", x[i], r, want);
        }
      }
    }
    printf("%s: %lld of 2^32 inputs differ from expf%s\n", sim_vexp_name((sim_vexp_id)m), bad,
           m == (int)sim_vexp_mode() ? " (in use)" : "");
    if (m == SIM_VEXP_AVX2) printf("glibc's plain build (scalar C): %lld of the |x| < 88 inputs differ from expf\n", plain_bad);
    if (bad) bad_total = 1;
  }
  return bad_total;
}
