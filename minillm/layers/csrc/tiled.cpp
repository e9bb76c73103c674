// A batch of rows times a weight matrix, in register tiles (rung 14, notebook 14).
//
// A decode step of 9-100 rows is a chain of products too short for a BLAS to settle in: oneDNN
// ran SmolLM2's fp32 chain at 46 rows at ~150-165 GFLOP/s where a 2048^3 product reaches ~220
// (docs/rungs/14_compiled.md). This is the textbook kernel that closes most of that gap:
//   * the weight is packed once into panels of 48 output columns, each stored k-major
//     ([K][48]): the inner loop reads 48 consecutive weights for each k, three vector loads;
//   * an 8 x 48 tile of y lives in 24 of AVX-512's 32 registers for the whole sum over k; each
//     step of k broadcasts one x value per row and does 24 FMAs with the three loaded vectors;
//   * a panel (48 x K weights, 110 KB at K = 576) stays in L2 while every tile of rows passes
//     over it, so the weight comes from memory once per product;
//   * the panels are split between torch's threads; 48 divides all of SmolLM2's widths into an
//     even number of panels (576 -> 12, 960 -> 20, 3072 -> 64, 49152 -> 1024), so two threads get
//     equal halves (64-column panels left 5 against 4 at 576 columns).
// bf16 (where the CPU has AVX512-BF16): the panel holds pairs of k ([K/2][48][2]) and each step
// is one `vdpbf16ps` -- two k at once, summed in fp32 -- on a broadcast pair of x.
// The bias and the residual are added as the tile is stored. Summation runs over k in order in
// one fp32 accumulator per output (oneDNN blocks k: the two differ by rounding only).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
static constexpr bool kTiles = true;
#else
static constexpr bool kTiles = false;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
static constexpr bool kBf16 = true;
#else
static constexpr bool kBf16 = false;
#endif

static constexpr int64_t kPanel = 48;   // output columns per panel: 3 vectors of 16 fp32
static constexpr int kRows = 8;         // rows per tile: 8 x 3 accumulators

// [N, K] -> the same shape, the values in panels of kPanel columns (the last one narrower), each
// [K][width] fp32, or [K/2][width][2] bf16.
torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(kTiles, "the tiled product needs AVX-512 (this build has none)");
  TORCH_CHECK(w.dim() == 2, "w: [out, in]");
  const bool bf16 = w.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(w.scalar_type() == torch::kFloat32 || (bf16 && kBf16),
              "the tiled product takes fp32 weights, or bf16 on a CPU with AVX512-BF16; got ",
              w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1);
  TORCH_CHECK(!bf16 || K % 2 == 0, "bf16 weights need an even number of inputs, got ", K);
  w = w.contiguous();
  auto out = torch::empty({N, K}, w.options());
  auto flat = out.view({-1});
  for (int64_t n0 = 0; n0 < N; n0 += kPanel) {
    const int64_t width = std::min(kPanel, N - n0);
    auto block = w.narrow(0, n0, width);                        // [width, K]
    auto dst = flat.narrow(0, n0 * K, width * K);
    if (bf16)   // [width, K/2, 2] -> [K/2, width, 2]
      dst.view({K / 2, width, 2}).copy_(block.reshape({width, K / 2, 2}).transpose(0, 1));
    else
      dst.view({K, width}).copy_(block.t());
  }
  return out;
}

#if defined(__AVX512F__)
template <typename T> struct Elt;
template <> struct Elt<float> {
  static constexpr int64_t kStep = 1;     // k per step
  static __m512 load_x(const float* x) { return _mm512_set1_ps(*x); }
  static __m512 load_w(const float* w, __mmask16 m) { return _mm512_maskz_loadu_ps(m, w); }
  static __m512 fma(__m512 acc, __m512 a, __m512 w) { return _mm512_fmadd_ps(a, w, acc); }
  static void put(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
  static __m512 load(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
};
#if defined(__AVX512BF16__)
template <> struct Elt<at::BFloat16> {
  static constexpr int64_t kStep = 2;     // a pair of k per vdpbf16ps
  static __m512 load_x(const at::BFloat16* x) {
    return _mm512_castsi512_ps(_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x)));
  }
  static __m512 load_w(const at::BFloat16* w, __mmask16 m) {    // 16 pairs of k
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(m, w));
  }
  static __m512 fma(__m512 acc, __m512 a, __m512 w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)w);
  }
  static void put(at::BFloat16* p, __m512 v, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
  }
  static __m512 load(const at::BFloat16* p, __mmask16 m) {   // bf16 -> fp32: a shift left
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
  }
};
#endif

struct Epilogue {
  const float* bias;      // [N] fp32 or null
  const void* residual;   // [M, N] in x's dtype or null
};

static inline __mmask16 lanes(int64_t left) {    // the first `left` of 16 lanes
  return left >= 16 ? __mmask16(0xFFFF) : left <= 0 ? __mmask16(0) : __mmask16((1u << left) - 1);
}

// y[R rows, the panel's `width` columns] = x[R, K] @ panel. A narrow last panel (N not a
// multiple of 48) loads and stores its last vector under a mask.
template <typename T, int R, int NV>
static inline void tile(const T* x, int64_t K, const T* p, int64_t width, T* y, int64_t N,
                        int64_t n0, int64_t m0, const Epilogue& e) {
  using E = Elt<T>;
  __mmask16 m[NV];
  for (int v = 0; v < NV; ++v) m[v] = lanes(width - v * 16);
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += E::kStep) {
    const T* pk = p + k * width;          // the step's width * kStep weights, contiguous
    __m512 w[NV];                         // loaded once, used by every row of the tile
    for (int v = 0; v < NV; ++v) w[v] = E::load_w(pk + v * 16 * E::kStep, m[v]);
    for (int r = 0; r < R; ++r) {
      const __m512 a = E::load_x(x + r * K + k);
      for (int v = 0; v < NV; ++v) acc[r][v] = E::fma(acc[r][v], a, w[v]);
    }
  }
  // unrolled, so acc[r][v] are registers: a loop the compiler left rolled indexes them, and an
  // indexed array lives in memory (the k loop then stored all 24 each step: 2.5x slower)
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t n = n0 + v * 16;
    const __m512 b = e.bias ? _mm512_maskz_loadu_ps(m[v], e.bias + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      __m512 out = _mm512_add_ps(acc[r][v], b);
      if (e.residual)
        out = _mm512_add_ps(
            out, E::load(static_cast<const T*>(e.residual) + (m0 + r) * N + n, m[v]));
      E::put(y + r * N + n, out, m[v]);
    }
  }
}

// Rows m0..m0+M of x times one panel: tiles of kRows rows, then one tile of the rest.
template <typename T, int NV>
static void panel(const T* x, int64_t M, int64_t m0, int64_t K, const T* p, int64_t width,
                  T* y, int64_t N, int64_t n0, const Epilogue& e) {
  int64_t m = m0;
  for (; m + kRows <= m0 + M; m += kRows)
    tile<T, kRows, NV>(x + m * K, K, p, width, y + m * N, N, n0, m, e);
  const T* xm = x + m * K;
  T* ym = y + m * N;
  switch (m0 + M - m) {
    case 1: tile<T, 1, NV>(xm, K, p, width, ym, N, n0, m, e); break;
    case 2: tile<T, 2, NV>(xm, K, p, width, ym, N, n0, m, e); break;
    case 3: tile<T, 3, NV>(xm, K, p, width, ym, N, n0, m, e); break;
    case 4: tile<T, 4, NV>(xm, K, p, width, ym, N, n0, m, e); break;
    case 5: tile<T, 5, NV>(xm, K, p, width, ym, N, n0, m, e); break;
    case 6: tile<T, 6, NV>(xm, K, p, width, ym, N, n0, m, e); break;
    case 7: tile<T, 7, NV>(xm, K, p, width, ym, N, n0, m, e); break;
    default: break;
  }
}

template <typename T>
static void run(const T* x, int64_t M, int64_t K, const T* P, T* y, int64_t N,
                const Epilogue& e) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  // Rows in chunks whose x fits in about half of L2 beside the panel: a prefill's thousands of
  // rows would otherwise stream x from memory once per panel.
  const int64_t chunk = std::max<int64_t>(kRows, (int64_t(1) << 19) / (K * int64_t(sizeof(T))));
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t n0 = i * kPanel, width = std::min(kPanel, N - n0);
        const T* p = P + n0 * K;
        switch ((width + 15) / 16) {
          case 3: panel<T, 3>(x, rows, m0, K, p, width, y, N, n0, e); break;
          case 2: panel<T, 2>(x, rows, m0, K, p, width, y, N, n0, e); break;
          default: panel<T, 1>(x, rows, m0, K, p, width, y, N, n0, e); break;
        }
      }
    });
  }
}
#endif

torch::Tensor tiled_mm(torch::Tensor x, torch::Tensor panels, c10::optional<torch::Tensor> bias,
                       c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(kTiles, "the tiled product needs AVX-512 (this build has none)");
  TORCH_CHECK(x.dim() == 2, "x: [rows, in]");
  TORCH_CHECK(panels.dim() == 2 && panels.size(1) == x.size(1) && panels.is_contiguous(),
              "panels: [out, in] matching x, as pack() made them");
  TORCH_CHECK(panels.scalar_type() == x.scalar_type(), "x (", x.scalar_type(),
              ") and the panels (", panels.scalar_type(), ") must share a dtype");
  const int64_t M = x.size(0), K = x.size(1), N = panels.size(0);
  x = x.contiguous();
  auto y = torch::empty({M, N}, x.options());
  torch::Tensor b, r;
  if (bias && bias->defined()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == N, "bias: ", b.numel(), " values for ", N, " outputs");
  }
  if (residual && residual->defined()) {
    r = residual->to(x.scalar_type()).contiguous();
    TORCH_CHECK(r.numel() == M * N, "residual: ", r.numel(), " values for ", M, " x ", N);
  }
  if (M == 0 || N == 0) return y;
#if defined(__AVX512F__)
  const Epilogue e{b.defined() ? b.data_ptr<float>() : nullptr,
                   r.defined() ? r.data_ptr() : nullptr};
  if (x.scalar_type() == torch::kFloat32) {
    run<float>(x.data_ptr<float>(), M, K, panels.data_ptr<float>(), y.data_ptr<float>(), N, e);
    return y;
  }
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16) {
    run<at::BFloat16>(x.data_ptr<at::BFloat16>(), M, K, panels.data_ptr<at::BFloat16>(),
                      y.data_ptr<at::BFloat16>(), N, e);
    return y;
  }
#endif
#endif
  TORCH_CHECK(false, "the tiled product takes fp32 rows, or bf16 with AVX512-BF16; got ",
              x.scalar_type());
  return y;
}

bool has_tiles() { return kTiles; }
bool has_bf16() { return kBf16; }

// An operator, so a compiled decode step (rung 14's graph) calls it from its generated code;
// the schema and the shape function are declared in layers/tiled.py.
TORCH_LIBRARY_IMPL(minillm, CPU, m) { m.impl("tiled_mm", &tiled_mm); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack", &pack, "w [out, in] -> the kernel's panels (fp32, or bf16 with AVX512-BF16)");
  m.def("has_tiles", &has_tiles, "whether this build has the AVX-512 kernel");
  m.def("has_bf16", &has_bf16, "whether it takes bf16 (AVX512-BF16)");
}
