/* vexp_body.h — included by vexp.c once per ISA (VEXP_SUFFIX avx2 / avx512, VEXP_FUSED 1 / 2, under
 * the matching target pragma): glibc's expf steps (its FMA build) on doubles, and the kernels' loops. */
#define VX_CAT2(a, b) a##_##b
#define VX_CAT(a, b) VX_CAT2(a, b)
#define VX(name) VX_CAT(name, VEXP_SUFFIX)

/* |x| >= 88 or NaN in any of the eight: glibc's special branch (top 12 bits of |x| >= those of
 * 88.0f); then all eight go through expf itself (*y) and the answer is 1. */
static inline __attribute__((always_inline)) int VX(special8)(__m256 x, const v8f *xp, v8f *y) {
  const __m256i top = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 20), _mm256_set1_epi32(0x7ff));
  if (_mm256_testz_si256(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(VX_TOP12_88 - 1)), _mm256_set1_epi32(-1)))
    return 0;
  for (int i = 0; i < 8; i++) (*y)[i] = expf((*xp)[i]);
  return 1;
}

#if VEXP_FUSED == 2
/* Eight of glibc's expf (its FMA build) on non-special inputs in one register of eight doubles (the
 * same double operations per element as the four-wide code); the table from four registers
 * (two-source permutes) instead of a gather. */
static inline __attribute__((always_inline)) v8f VX(exp8)(const v8f *xp) {
  const __m256 x = (__m256)*xp;
  v8f special;
  if (__builtin_expect(VX(special8)(x, xp, &special), 0)) return special;
  const __m512d shift = _mm512_set1_pd(VX_SHIFT), inv = _mm512_set1_pd(VX_INVLN2N);
  const __m512d xd = _mm512_cvtps_pd(x);
  __m512d kd = _mm512_fmadd_pd(xd, inv, shift);
  const __m512i ki = _mm512_castpd_si512(kd);
  kd = _mm512_sub_pd(kd, shift);
  const __m512d r = _mm512_fmsub_pd(xd, inv, kd);
  const __m512i t0 = _mm512_loadu_si512(sim_vexp_tab), t1 = _mm512_loadu_si512(sim_vexp_tab + 8);
  const __m512i t2 = _mm512_loadu_si512(sim_vexp_tab + 16), t3 = _mm512_loadu_si512(sim_vexp_tab + 24);
  const __m512i lo = _mm512_permutex2var_epi64(t0, ki, t1), hi = _mm512_permutex2var_epi64(t2, ki, t3);
  const __mmask8 upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
  const __m512i t = _mm512_add_epi64(_mm512_mask_blend_epi64(upper, lo, hi), _mm512_slli_epi64(ki, 47));
  const __m512d z = _mm512_fmadd_pd(_mm512_set1_pd(VX_C0), r, _mm512_set1_pd(VX_C1)), r2 = _mm512_mul_pd(r, r);
  __m512d y = _mm512_fmadd_pd(_mm512_set1_pd(VX_C2), r, _mm512_set1_pd(1.0));
  y = _mm512_fmadd_pd(z, r2, y);
  y = _mm512_mul_pd(y, _mm512_castsi512_pd(t));
  return (v8f)_mm512_cvtpd_ps(y);
}
#else
/* Eight of glibc's expf (its FMA build) on non-special inputs, in two halves of four doubles. */
static inline __attribute__((always_inline)) __m128 VX(exp4)(__m128 x, const __m256d inv, const __m256d shift,
                                                            const __m256d c0, const __m256d c1, const __m256d c2,
                                                            const __m256d one) {
  const __m256d xd = _mm256_cvtps_pd(x);
  __m256d kd = _mm256_fmadd_pd(xd, inv, shift);
  const __m256i ki = _mm256_castpd_si256(kd);
  kd = _mm256_sub_pd(kd, shift);
  const __m256d r = _mm256_fmsub_pd(xd, inv, kd);
  const __m256i t = _mm256_add_epi64(
      _mm256_i64gather_epi64((const long long *)sim_vexp_tab, _mm256_and_si256(ki, _mm256_set1_epi64x(31)), 8),
      _mm256_slli_epi64(ki, 47));
  const __m256d z = _mm256_fmadd_pd(c0, r, c1), r2 = _mm256_mul_pd(r, r);
  __m256d y = _mm256_fmadd_pd(c2, r, one);
  y = _mm256_fmadd_pd(z, r2, y);
  y = _mm256_mul_pd(y, _mm256_castsi256_pd(t));
  return _mm256_cvtpd_ps(y);
}

static inline __attribute__((always_inline)) v8f VX(exp8)(const v8f *xp) {
  const __m256 x = (__m256)*xp;
  v8f special;
  if (__builtin_expect(VX(special8)(x, xp, &special), 0)) return special;
  const __m256d inv = _mm256_set1_pd(VX_INVLN2N), shift = _mm256_set1_pd(VX_SHIFT), c0 = _mm256_set1_pd(VX_C0),
                c1 = _mm256_set1_pd(VX_C1), c2 = _mm256_set1_pd(VX_C2), one = _mm256_set1_pd(1.0);
  const __m128 a = VX(exp4)(_mm256_castps256_ps128(x), inv, shift, c0, c1, c2, one);
  const __m128 b = VX(exp4)(_mm256_extractf128_ps(x, 1), inv, shift, c0, c1, c2, one);
  return (v8f)_mm256_insertf128_ps(_mm256_castps128_ps256(a), b, 1);
}
#endif

static void VX(exp_n)(const float *x, float *y, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f xv = ld8(x + i), e = VX(exp8)(&xv);
    memcpy(y + i, &e, sizeof e);
  }
  for (; i < n; i++) y[i] = expf(x[i]);
}

static void VX(silu)(float *g, const float *u, int n) {
  const v8f one = {1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f, 1.f};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f gv = ld8(g + i), ng = -gv;
    const v8f r = (gv / (one + VX(exp8)(&ng))) * ld8(u + i);
    memcpy(g + i, &r, sizeof r);
  }
  for (; i < n; i++) g[i] = (g[i] / (1.0f + expf(-g[i]))) * u[i];
}

static void VX(exp_shift)(float *x, int n, float m) {
  const v8f mv = {m, m, m, m, m, m, m, m};
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    const v8f d = ld8(x + i) - mv, e = VX(exp8)(&d);
    memcpy(x + i, &e, sizeof e);
  }
  for (; i < n; i++) x[i] = expf(x[i] - m);
}

#undef VX
#undef VX_CAT
#undef VX_CAT2
