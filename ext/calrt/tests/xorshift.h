/* xorshift.h — the seeded xorshift64 stream of the C tests of ext/'s sampler cores (test_vexp64.c,
 * test_topp.c): define XORSHIFT_SEED, then include. next() is the next 64-bit value, unit() a
 * double in [0, 1) from its top 53 bits. */
#include <stdint.h>

static uint64_t rng = XORSHIFT_SEED;
static uint64_t next(void) {
  rng ^= rng << 13;
  rng ^= rng >> 7;
  rng ^= rng << 17;
  return rng;
}
static double unit(void) { return (double)(next() >> 11) * 0x1p-53; }
