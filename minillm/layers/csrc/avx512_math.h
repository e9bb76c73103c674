// AVX-512 pieces shared by the core's fused layer ops (fused_ops.cpp) and rung 4's attention
// kernels (attention/csrc): 16 lanes of fp32 from fp32 or bf16 rows, and a vector exp.
// cpp_build hashes and copies this directory's headers with every extension it builds.
#pragma once
#if defined(__AVX512F__)
#include <torch/extension.h>
#include <immintrin.h>

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {   // bf16 is fp32's top half: shift it up
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// e^x (x below -100 taken as -100): 2^n * 2^f, |f| <= 1/2, 2^f by its Taylor series to degree 6
// (relative error ~1e-7, fp32's own), 2^n by vscalefps.
static inline __m512 exp16(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.f)),
                                 _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  static const float c[7] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720};
  __m512 p = _mm512_set1_ps(c[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return _mm512_scalef_ps(p, n);
}
#endif  // __AVX512F__
