// The elementwise work of a decoder layer, one pass each (rung 3's forward, notebook 04).
//
// In eager torch a layer's RMSNorm is five passes over the activations (widen, square-mean,
// scale, narrow, times the weight), RoPE six (slice, negate, concatenate, two products, a sum)
// and SiLU-times-up three, each a dispatch and a fork/join of the thread team: at 128 decode rows
// the tensors are a few hundred KB, so the passes cost their overheads, not their bytes. Here
// each is one loop over the rows, computed in fp32 and rounded to bf16/fp16 once at the end,
// with the same roundings as Hugging Face's layer where it rounds (RMSNorm narrows before the
// weight). An fp32 model gets the same loops with nothing to round: they differ from eager torch
// only in the order of the additions, and its tokens are still checked against Hugging Face's.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <type_traits>

#include <cstring>

// Conversions the compiler can vectorize: bf16 is fp32's top half, so widening is a shift and
// narrowing rounds to nearest-even in integer arithmetic (what torch's conversion does; NaN
// stays NaN -- tested on the bits, which -ffast-math cannot assume away). fp16 goes through c10.
template <typename T> static inline float widen(T x) { return static_cast<float>(x); }
template <typename T> static inline T narrow(float x) { return static_cast<T>(x); }
template <> inline float widen(c10::BFloat16 x) {
  const uint32_t u = uint32_t(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
template <> inline c10::BFloat16 narrow(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  const uint16_t r = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return c10::BFloat16(nan ? uint16_t(0x7fc0) : r, c10::BFloat16::from_bits());
}

#if defined(__AVX512F__)
#include <immintrin.h>
#include "avx512_math.h"   // load16 of fp32 and bf16 rows (16 lanes at a time), exp16
static inline __m512 round16(__m512 x) {        // to the nearest bf16 (even on ties), as fp32
  const __m512i u = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i out = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_castsi512_ps(_mm512_and_si512(out, _mm512_set1_epi32(int(0xffff0000u))));
}
static inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
// rounded to T's precision, kept in fp32 (Hugging Face narrows there; fp32 has nothing to round)
template <typename T> static inline __m512 round_to(__m512 x) {
  if constexpr (std::is_same_v<T, float>) return x; else return round16(x);
}
static inline void store16(c10::BFloat16* p, __m512 x) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));  // one op
#else
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round16(x)), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(top));
#endif
}
// 1 / x to fp32's precision without a division (slow in vector form): an estimate good to
// 14 bits, then one Newton step.
static inline __m512 recip16(__m512 x) {
  const __m512 r = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.f)));
}
#endif

// x [T, N] -> rms_norm(x) * w, HF's order: x * rsqrt(mean(x^2) + eps) in fp32, narrowed, then
// times the weight (in the weight's type, i.e. narrowed again).
template <typename T>
static void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
#if defined(__AVX512F__)
      if constexpr (!std::is_same_v<T, c10::Half>) {   // bf16 and fp32: 16 lanes
        if (n % 16 == 0) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t i = 0; i < n; i += 16) {
            const __m512 v = load16(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
          }
          const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(acc) / float(n) + eps));
          for (int64_t i = 0; i < n; i += 16)
            store16(out + r * n + i, _mm512_mul_ps(round_to<T>(_mm512_mul_ps(load16(xr + i), inv)), load16(w + i)));
          continue;
        }
      }
#endif
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += widen(xr[i]) * widen(xr[i]);
      const float inv = 1.f / std::sqrt(ss / float(n) + eps);
      T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) o[i] = narrow<T>(widen(narrow<T>(widen(xr[i]) * inv)) * widen(w[i]));
    }
  });
}

// qkv [T, (H + 2 KVH) D]: q and k heads rotated by their position's angle (cos/sin [T, D], the
// halves convention of Llama), written to q_out [T, H, D] and k_out [T, KVH, D] -- contiguous,
// as the attention kernel reads them.
template <typename T>
static void rope_rows(const T* qkv, const T* cos, const T* sin, T* q_out, T* k_out, int64_t rows,
                      int64_t H, int64_t KVH, int64_t D) {
  const int64_t width = (H + 2 * KVH) * D, half = D / 2;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * D;
      const T* s = sin + r * D;
      for (int64_t h = 0; h < H + KVH; ++h) {
        const T* x = qkv + r * width + h * D;
        T* o = h < H ? q_out + (r * H + h) * D : k_out + (r * KVH + h - H) * D;
#if defined(__AVX512F__)
        if constexpr (!std::is_same_v<T, c10::Half>) {   // bf16 and fp32: 16 lanes
          if (half % 16 == 0) {
            for (int64_t i = 0; i < half; i += 16) {
              const __m512 a = load16(x + i), b = load16(x + i + half);
              store16(o + i, _mm512_fmsub_ps(a, load16(c + i), _mm512_mul_ps(b, load16(s + i))));
              store16(o + i + half, _mm512_fmadd_ps(b, load16(c + i + half),
                                                    _mm512_mul_ps(a, load16(s + i + half))));
            }
            continue;
          }
        }
#endif
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = widen(x[i]), b = widen(x[i + half]);
          o[i] = narrow<T>(a * widen(c[i]) - b * widen(s[i]));
          o[i + half] = narrow<T>(b * widen(c[i + half]) + a * widen(s[i + half]));
        }
      }
    }
  });
}

// gate_up [T, 2I] -> silu(gate) * up [T, I]
template <typename T>
static void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * 2 * inter;
      const T* u = g + inter;
      T* o = out + r * inter;
#if defined(__AVX512F__)
      if constexpr (!std::is_same_v<T, c10::Half>) {   // bf16 and fp32: 16 lanes
        if (inter % 16 == 0) {
          for (int64_t i = 0; i < inter; i += 16) {
            const __m512 a = load16(g + i);
            const __m512 sig = recip16(
                _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), a))));
            store16(o + i, _mm512_mul_ps(_mm512_mul_ps(a, sig), load16(u + i)));
          }
          continue;
        }
      }
#endif
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) {
        const float a = widen(g[i]);
        o[i] = narrow<T>(a / (1.f + std::exp(-a)) * widen(u[i]));
      }
    }
  });
}

static void check_16bit(const torch::Tensor& t, const char* name) {
  const auto type = t.scalar_type();
  TORCH_CHECK(t.device().is_cpu() && (type == at::kBFloat16 || type == at::kHalf || type == at::kFloat),
              name, " must be a bf16, fp16 or fp32 CPU tensor, got ", type);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

#define DISPATCH_16(type, ...)                                                                  \
  if ((type) == at::kBFloat16) { using scalar_t = c10::BFloat16; __VA_ARGS__(); }               \
  else if ((type) == at::kFloat) { using scalar_t = float; __VA_ARGS__(); }                     \
  else { using scalar_t = c10::Half; __VA_ARGS__(); }

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_16bit(x, "x");
  check_16bit(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              "rms_norm: x [T, N] and w [N] of one dtype");
  auto out = torch::empty_like(x);
  DISPATCH_16(x.scalar_type(), [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.size(0), x.size(1), float(eps));
  });
  return out;
}

std::vector<torch::Tensor> rope(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t H,
                                int64_t KVH) {
  check_16bit(qkv, "qkv");
  check_16bit(cos, "cos");
  check_16bit(sin, "sin");
  const int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * KVH) * D && D % 2 == 0 &&
              cos.sizes() == sin.sizes() && cos.size(0) == T && cos.scalar_type() == qkv.scalar_type(),
              "rope: qkv [T, (H + 2 KVH) D], cos and sin [T, D] of qkv's dtype");
  auto q = torch::empty({T, H, D}, qkv.options());
  auto k = torch::empty({T, KVH, D}, qkv.options());
  DISPATCH_16(qkv.scalar_type(), [&] {
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), T, H, KVH, D);
  });
  return {q, k};
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_16bit(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul: gate_up [T, 2I]");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  DISPATCH_16(gate_up.scalar_type(), [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate_up.size(0),
                            gate_up.size(1) / 2);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of fp32/bf16/fp16 rows, fp32 inside (CPU)");
  m.def("rope", &rope, "rotary embedding of q and k heads into contiguous q, k (CPU)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up (CPU)");
}
