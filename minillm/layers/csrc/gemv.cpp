// A few rows times a weight matrix, streamed once (rung 14, notebook 14).
//
// At one decode row a linear layer reads every weight once and does two FLOPs per weight: its
// time is the weight's bytes over the memory's bandwidth, if the kernel keeps the memory busy.
// BLAS and oneDNN are built for many rows (tiles of W reused across rows of x); at one row they
// reached 7-9 GB/s of weight on the lab CPU where a copy streams ~14 (docs/rungs/14_compiled.md).
// This loop reads each row of W once, for every row of x together (W's row stays in L1 while
// the x rows pass over it), with four independent accumulators so the FMAs do not wait on one
// another. An int8 W is widened eight weights at a time in registers and its row's scale
// applied to the sum: the memory moves one byte per weight, never the widened copy; a bf16 W
// moves two (a bf16 is the top half of an fp32: widening is a shift). bf16 activations are
// taken to fp32 once per call and y is rounded back to bf16 once, after the residual's add.
// Output rows are split across torch's threads (at::parallel_for), a block of rows each.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

// Ask for the weight bytes a little ahead of the row being summed, into L2: the hardware's own
// streamer runs only so far ahead, and a product of a one-row step is too short for it to reach
// the memory's speed. SmolLM2's 121 int8 products of a step (134 MB) on huge pages, best of 15
// passes, twice (one_stream.page_times): 7.7-7.8 ms without; 6.5-6.6 at 1 KB ahead, 6.2-6.5 at
// 2 KB, 6.5-6.6 at 4 KB.
#if defined(__SSE__)
#include <xmmintrin.h>
#endif
static constexpr int64_t kPrefetchBytes = 2048;
static inline void prefetch_row(const void* row, int64_t bytes) {
#if defined(__SSE__)
  const char* p = static_cast<const char*>(row) + kPrefetchBytes;
  for (int64_t l = 0; l < bytes; l += 64) _mm_prefetch(p + l, _MM_HINT_T1);
#else
  (void)row; (void)bytes;
#endif
}

// Each thread's block of W's rows is read as kStreams interleaved runs (rows begin, begin + q,
// begin + 2q, ... then begin + 1, ...): several sequential streams in flight at once keep more of
// the memory's requests outstanding than one. SmolLM2's 121 int8 products of a step on huge
// pages (one_stream.page_times, best of 12, twice): 7.3-7.4 ms as one run, 6.0-6.7 as two,
// 5.7-6.0 as four, 5.9-6.2 as eight.
static constexpr int64_t kStreams = 4;
template <typename F>
static inline void for_rows(int64_t begin, int64_t end, F&& row) {
  const int64_t q = (end - begin) / kStreams;
  for (int64_t i = 0; i < q; ++i)
    for (int64_t k = 0; k < kStreams; ++k) row(begin + k * q + i);
  for (int64_t o = begin + kStreams * q; o < end; ++o) row(o);
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
static inline __m256 load8(const c10::BFloat16* w) {   // eight bf16: the fp32's top halves
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline __m256 load8(const int8_t* w) {   // eight int8 weights, widened to fp32 lanes
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

template <typename T>
static inline float dot(const T* w, const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    a0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(x + i), a0);
    a1 = _mm256_fmadd_ps(load8(w + i + 8), _mm256_loadu_ps(x + i + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + i + 16), _mm256_loadu_ps(x + i + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + i + 24), _mm256_loadu_ps(x + i + 24), a3);
  }
  for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(load8(w + i), _mm256_loadu_ps(x + i), a0);
  float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
  for (; i < n; ++i) s += float(w[i]) * x[i];
  return s;
}
#if defined(__AVX512F__)
// fp32 and int8 weights, where the CPU has AVX-512: sixteen weights a load (int8 ones widened in
// registers), the tail masked; these overloads are taken before the eight-lane template above
static inline __m512 load16(const float* w, __mmask16 m) { return _mm512_maskz_loadu_ps(m, w); }
static inline __m512 load16(const int8_t* w, __mmask16 m) {
  __m128i b;
  if (m == 0xFFFF) {
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  } else {                                    // the row's last < 16 weights, zero-padded
    alignas(16) int8_t tail[16] = {0};
    for (int j = 0; (m >> j) & 1; ++j) tail[j] = w[j];
    b = _mm_load_si128(reinterpret_cast<const __m128i*>(tail));
  }
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

template <typename T>
static inline float dot16(const T* w, const float* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_fmadd_ps(load16(w + i, 0xFFFF), _mm512_loadu_ps(x + i), a0);
    a1 = _mm512_fmadd_ps(load16(w + i + 16, 0xFFFF), _mm512_loadu_ps(x + i + 16), a1);
    a2 = _mm512_fmadd_ps(load16(w + i + 32, 0xFFFF), _mm512_loadu_ps(x + i + 32), a2);
    a3 = _mm512_fmadd_ps(load16(w + i + 48, 0xFFFF), _mm512_loadu_ps(x + i + 48), a3);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
    a0 = _mm512_fmadd_ps(load16(w + i, m), _mm512_maskz_loadu_ps(m, x + i), a0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
}
static inline float dot(const float* w, const float* x, int64_t n) { return dot16(w, x, n); }
static inline float dot(const int8_t* w, const float* x, int64_t n) { return dot16(w, x, n); }
#endif
#else
template <typename T>
static inline float dot(const T* w, const float* x, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += float(w[i]) * x[i];
  return s;
}
#endif

// bf16 weights and bf16 rows (a bf16 model's decode step), where the CPU has AVX512-BF16:
// vdpbf16ps multiplies 32 bf16 pairs exactly and adds them into 16 fp32 sums in one instruction,
// where the loops above widen the weights and the rows' numbers for one FMA. The same products,
// summed in another order; measured in docs/rungs/14_compiled.md.
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
static constexpr bool kBf16Dot = true;
static inline __m512bh bf16x32(const c10::BFloat16* p, __mmask32 m = ~0u) {
  return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
}
static inline float dot(const c10::BFloat16* w, const c10::BFloat16* x, int64_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    a0 = _mm512_dpbf16_ps(a0, bf16x32(x + i), bf16x32(w + i));
    a1 = _mm512_dpbf16_ps(a1, bf16x32(x + i + 32), bf16x32(w + i + 32));
  }
  for (; i < n; i += 32) {
    const __mmask32 m = n - i >= 32 ? ~0u : (1u << (n - i)) - 1;
    a0 = _mm512_dpbf16_ps(a0, bf16x32(x + i, m), bf16x32(w + i, m));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

#else
static constexpr bool kBf16Dot = false;
#endif

// y [R, O] = x [R, I] @ W[O, I].T (* scale[O]) (+ bias[O]) (+ residual[R, O]): x in X (fp32, or
// bf16 on bf16 weights where the CPU has AVX512-BF16, below), scale and bias in fp32, W in T
// (fp32, bf16, int8), the residual and y in the activations' type A (fp32, bf16)
template <typename X, typename T, typename A>
static void run(const X* x, const T* w, const float* scale, const float* bias,
                const A* residual, A* y, int64_t R, int64_t I, int64_t O) {
  const int64_t grain = 16;
  at::parallel_for(0, O, grain, [&](int64_t begin, int64_t end) {
    for_rows(begin, end, [&](int64_t o) {
      const T* row = w + o * I;
      prefetch_row(row, I * int64_t(sizeof(T)));
      const float s = scale ? scale[o] : 1.f, b = bias ? bias[o] : 0.f;
      for (int64_t r = 0; r < R; ++r) {
        float v = dot(row, x + r * I, I) * s + b;
        y[r * O + o] = A(residual ? float(residual[r * O + o]) + v : v);
      }
    });
  });
}

static const float* opt(const c10::optional<torch::Tensor>& t, int64_t n, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == n,
              name, ": a contiguous fp32 tensor of ", n, " numbers");
  return t->data_ptr<float>();
}

template <typename A>
static const A* residual_of(const c10::optional<torch::Tensor>& t, const torch::Tensor& x,
                            int64_t n) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == x.scalar_type() && t->is_contiguous() && t->numel() == n,
              "residual: a contiguous tensor of ", n, " numbers in x's dtype");
  return t->data_ptr<A>();
}

template <typename A>
static void dispatch_w(const torch::Tensor& xf, const torch::Tensor& x, const torch::Tensor& w,
                       const float* s, const float* b,
                       const c10::optional<torch::Tensor>& residual, torch::Tensor& y) {
  const int64_t R = x.size(0), I = x.size(1), O = w.size(0);
  const A* res = residual_of<A>(residual, x, R * O);
  const float* xp = xf.data_ptr<float>();
  A* out = y.data_ptr<A>();
  if (w.scalar_type() == torch::kInt8)
    run(xp, w.data_ptr<int8_t>(), s, b, res, out, R, I, O);
  else if (w.scalar_type() == torch::kBFloat16)
    run(xp, w.data_ptr<c10::BFloat16>(), s, b, res, out, R, I, O);
  else
    run(xp, w.data_ptr<float>(), s, b, res, out, R, I, O);
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> scale,
                   c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || bf16),
              "x: [rows, in] fp32 or bf16");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1), "w: [out, in] matching x");
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || w.scalar_type() == torch::kBFloat16 ||
              w.scalar_type() == torch::kInt8, "w: fp32, bf16 or int8");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  const float* s = opt(scale, w.size(0), "scale");
  const float* b = opt(bias, w.size(0), "bias");
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (bf16 && w.scalar_type() == torch::kBFloat16) {   // bf16 dot products, no fp32 copy of x
    run(x.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), s, b,
        residual_of<c10::BFloat16>(residual, x, x.size(0) * w.size(0)),
        y.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), w.size(0));
    return y;
  }
#endif
  // a few rows of x in fp32 once (the weights are what streams; x stays in L1)
  const torch::Tensor xf = bf16 ? x.to(torch::kFloat32) : x;
  if (bf16)
    dispatch_w<c10::BFloat16>(xf, x, w, s, b, residual, y);
  else
    dispatch_w<float>(xf, x, w, s, b, residual, y);
  return y;
}

// --- w8a8: int8 activations too (quantization="w8a8"), on the CPU's int8 dot products -----------
// Each row of x gets its own scale (max|x| / 127, as layers/quant.py's quantize_per_token) and is
// rounded to int8 once per call; then every weight row is a sum of int8 x int8 products in int32,
// exact, scaled by both scales afterwards. AVX512-VNNI's vpdpbusd does 64 such products in one
// instruction, where the int8-weight loop above widens 8 weights to fp32 for one FMA: the weight
// is read at the memory's speed instead of at the widening's. vpdpbusd multiplies unsigned by
// signed bytes, so x enters as |x| and its sign moves onto the weight (w or -w, by a mask):
// -127..127 codes make both exact.
static void quantize_row(const float* x, int64_t n, int8_t* q, float* scale) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  for (int64_t i = 0; i < n; ++i)
    q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[i] / s))));
  *scale = s;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static constexpr bool kVnni = true;
// |xq| (padded with zeros to a multiple of 64) and the sign of each 64-byte chunk
using Mask = unsigned long long;      // one bit per byte of a 64-byte chunk (AVX-512's __mmask64)

static inline int32_t dot_i8(const int8_t* w, const uint8_t* ax, const Mask* neg, int64_t n) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i a0 = zero, a1 = zero;
  int64_t i = 0, c = 0;
  for (; i + 128 <= n; i += 128, c += 2) {
    __m512i w0 = _mm512_loadu_si512(w + i), w1 = _mm512_loadu_si512(w + i + 64);
    w0 = _mm512_mask_sub_epi8(w0, neg[c], zero, w0);
    w1 = _mm512_mask_sub_epi8(w1, neg[c + 1], zero, w1);
    a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(ax + i), w0);
    a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512(ax + i + 64), w1);
  }
  for (; i < n; i += 64, ++c) {       // the last chunks; the weight row ends mid-chunk
    const __mmask64 m = n - i >= 64 ? ~0ULL : (1ULL << (n - i)) - 1;
    __m512i w0 = _mm512_maskz_loadu_epi8(m, w + i);
    w0 = _mm512_mask_sub_epi8(w0, neg[c], zero, w0);
    a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512(ax + i), w0);
  }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
}
#else
static constexpr bool kVnni = false;
using Mask = unsigned long long;

static inline int32_t dot_i8(const int8_t* w, const uint8_t* ax, const Mask* neg, int64_t n) {
  int32_t s = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t a = ax[i];
    s += ((neg[i / 64] >> (i % 64)) & 1) ? -a * w[i] : a * w[i];
  }
  return s;
}
#endif

torch::Tensor gemv_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor scale,
                        c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [rows, in] fp32");
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.scalar_type() == torch::kInt8,
              "w: [out, in] int8 matching x");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t R = x.size(0), I = x.size(1), O = w.size(0), chunks = (I + 63) / 64;
  const float* ws = opt(scale, O, "scale");
  const float* b = opt(bias, O, "bias");
  const float* res = opt(residual, R * O, "residual");
  std::vector<uint8_t> ax(R * chunks * 64, 0);
  std::vector<Mask> neg(R * chunks, 0);
  std::vector<int8_t> q(I);
  std::vector<float> xs(R);
  for (int64_t r = 0; r < R; ++r) {
    quantize_row(x.data_ptr<float>() + r * I, I, q.data(), &xs[r]);
    for (int64_t i = 0; i < I; ++i) {
      ax[r * chunks * 64 + i] = static_cast<uint8_t>(std::abs(q[i]));
      if (q[i] < 0) neg[r * chunks + i / 64] |= Mask(1) << (i % 64);
    }
  }
  auto y = torch::empty({R, O}, x.options());
  float* out = y.data_ptr<float>();
  const int8_t* W = w.data_ptr<int8_t>();
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    for_rows(begin, end, [&](int64_t o) {
      prefetch_row(W + o * I, I);
      for (int64_t r = 0; r < R; ++r) {
        const int32_t acc = dot_i8(W + o * I, ax.data() + r * chunks * 64,
                                   neg.data() + r * chunks, I);
        float v = float(acc) * xs[r] * ws[o] + (b ? b[o] : 0.f);
        out[r * O + o] = res ? res[r * O + o] + v : v;
      }
    });
  });
  return y;
}

bool has_vnni() { return kVnni; }
bool has_bf16_dot() { return kBf16Dot; }

// An operator of torch's, not only a Python function: a compiled decode step (rung 14's graph)
// calls it from its generated code through the dispatcher, with no Python around each product.
// Its schema and its shape function (for the tracer) are declared in layers/gemv.py.
TORCH_LIBRARY_IMPL(minillm, CPU, m) {
  m.impl("gemv", &gemv);
  m.impl("gemv_w8a8", &gemv_w8a8);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemv", &gemv, "y = x @ w.T (* scale) (+ bias) (+ residual), fp32 or int8 w",
        py::arg("x"), py::arg("w"), py::arg("scale") = py::none(), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("has_vnni", &has_vnni, "whether gemv_w8a8 was built with AVX512-VNNI");
  m.def("has_bf16_dot", &has_bf16_dot, "whether bf16 rows on bf16 weights use AVX512-BF16");
}
