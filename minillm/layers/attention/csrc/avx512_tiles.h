// AVX-512 building blocks of the decode (paged_decode.cpp) and prefill (paged_extend.h)
// kernels: 16-token tiles of a paged pool, loads that widen fp16 and int8 rows to fp32, a
// transposing reduction, prefetches, and bf16 dot products (AVX512-BF16). Included by
// paged_decode.cpp, the extension's one source (cpp_build hashes this directory's headers with
// it, so an edit here rebuilds it).
#pragma once
#if defined(__AVX512F__)
#include <torch/extension.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <type_traits>
#include "avx512_math.h"   // load16 of fp32 and bf16 rows, exp16 (minillm/core/csrc)


static inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// r[j] = the sum of v[j]'s 16 lanes: pairs, then 128-bit lanes, folded together.
static inline __m512 reduce16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)   // lanes: v[2i], v[2i+1], v[2i], v[2i+1] per 128-bit lane
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)   // each 128-bit lane: one partial sum of v[4i .. 4i+3]
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

// One tile's rows of one KV head as fp32 pointers: into the pool itself (fp32), or into `buf`
// where the 16-bit / int8 rows are widened once for all the query heads that read them.
template <typename S, int D>
static inline void tile_rows(const S* pool, const int64_t* slots, int n, int64_t stride,
                             float* buf, const float** rows) {
  for (int j = 0; j < 16; ++j) {
    if constexpr (std::is_same_v<S, float>) {
      rows[j] = pool + slots[std::min(j, n - 1)] * stride;   // past the end: any valid row
    } else {
      float* dst = buf + j * D;
      const S* src = pool + slots[std::min(j, n - 1)] * stride;
      for (int c = 0; c < D; c += 16) _mm512_storeu_ps(dst + c, load16(src + c));
      rows[j] = dst;
    }
  }
}

// A tile = 16 context tokens. With blocks of 16 (the default) a tile is one block: 16 tokens x
// all KV heads, one contiguous stretch of the pool that the loop walks in order.
struct Tile {
  int64_t slots[16];
  int n;
  void fill(const int32_t* table, int64_t t0, int64_t L, int64_t block_size) {
    n = int(std::min<int64_t>(16, L - t0));
    for (int j = 0; j < n; ++j) {
      const int64_t t = t0 + j;
      slots[j] = int64_t(table[t / block_size]) * block_size + t % block_size;
    }
  }
};

// A prefetch into L2 (prefetcht1) the compiler cannot drop. _mm_prefetch has no side effect in
// GCC's eyes, so a helper made only of prefetches is judged "pure" and every call to it deleted:
// until 2026-11-27 this kernel's prefetches compiled to nothing (`objdump -d` of the built
// module: 0 prefetch instructions).
static inline void prefetch_l2(const char* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); }

// Ask for the K and V rows of the tile at t0 (if any) before they are needed: blocks sit anywhere
// in the pool, so the hardware cannot guess where the next one starts, and one tile's arithmetic
// is too short to cover a trip to memory. Bytes [from, to) of each token's rows: one KV head's
// part, asked for while the same head of the tile before is computed, so the requests are spread
// over the tile's arithmetic. Issued all at once per tile (192 lines at SmolLM2's shape), they
// filled the core's queue of misses and the kernel waited on its own prefetches (perf: 14% of
// its samples on prefetcht1).
template <typename S>
static inline void prefetch_tile(const S* k_pool, const S* v_pool, const int32_t* table,
                                 int64_t t0, int64_t L, int64_t block_size, int64_t row_bytes,
                                 int64_t from = 0, int64_t to = -1) {
  if (to < 0) to = row_bytes;
  for (int64_t t = t0; t < std::min<int64_t>(L, t0 + 16); ++t) {
    const int64_t off = (int64_t(table[t / block_size]) * block_size + t % block_size) * row_bytes;
    const char* k = reinterpret_cast<const char*>(k_pool) + off;
    const char* v = reinterpret_cast<const char*>(v_pool) + off;
    for (int64_t o = from; o < to; o += 64) {
      prefetch_l2(k + o);
      prefetch_l2(v + o);
    }
  }
}
// One tile ahead, into L2 (T1). Spread per KV head (above), one tile ahead beat two and three
// (bf16, 128 x 155, 30 pools, 2 threads: 1120 vs 1289 and 1333 us per layer, one run); issued per
// tile, two had beaten one, four and eight, and T1 had beaten T0 (K and V of a 16-token block are
// 12 KB here: more in flight, or into L1, evicts the tile being computed).
constexpr int64_t kAhead = 1;

// 16 scores of one query head against one tile's K rows, fp32 arithmetic.
template <int D>
static inline __m512 scores16(const float* qh, const float* const* rows) {
  __m512 qv[D / 16], acc[16];
  for (int c = 0; c < D / 16; ++c) qv[c] = _mm512_loadu_ps(qh + c * 16);
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(rows[j]));
    for (int c = 1; c < D / 16; ++c)
      acc[j] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(rows[j] + c * 16), acc[j]);
  }
  return reduce16(acc);
}

#if defined(__AVX512BF16__)
// The same from bf16 rows in place and a bf16 query, two products per instruction (vdpbf16ps):
// a product of two bf16 numbers is exact in fp32, so only the order of the sum differs -- and
// nothing is widened. Used when the model computes in bf16 (its query is bf16 already).
template <int D>
static inline __m512 scores16_bf16(const c10::BFloat16* qh, const c10::BFloat16* const* rows) {
  __m512bh qv[D / 32];
  __m512 acc[16];
  for (int c = 0; c < D / 32; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(qh + c * 32);
  for (int j = 0; j < 16; ++j) {
    acc[j] = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; ++c)
      acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], (__m512bh)_mm512_loadu_si512(rows[j] + c * 32));
  }
  return reduce16(acc);
}
#endif

// A V row as C fp32 vectors. A bf16 row is widened by interleaving it with zeros (unpacklo/hi):
// one load and two unpacks per 32 values instead of a load, a widening and a shift per 16, but
// the values come out in a fixed lane order -- per 128-bit lane k, values 8k..8k+3, then 8k+4 ..
// 8k+7 -- which the sums keep until `in_order` puts them back at the end.
template <typename S, int D>
static inline void v_row(const S* v, __m512* out) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    for (int c = 0; c < D / 32; ++c) {
      const __m512i raw = _mm512_loadu_si512(v + c * 32);
      out[2 * c] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), raw));
      out[2 * c + 1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), raw));
    }
  } else {
    for (int c = 0; c < D / 16; ++c) out[c] = load16(v + c * 16);
  }
}

// The weighted sum of one tile's V rows into NH query heads at once (fp32 arithmetic): each row
// is loaded, and widened if stored narrower, once for the NH heads of its group -- per head, it
// was loaded and widened NH times. The sums per head are added in the same order as before, so
// the outputs are bit for bit the same; at SmolLM2's shape (3 heads a group), 32 rows x 192
// tokens x 30 layers, fp16 pool, 2 threads: see docs/rungs/14_compiled.md.
template <typename S, int D, int NH>
static inline void pv_rows(const S* vpool, const int64_t* slots, int n, int64_t stride,
                           const float (*p)[16], const float* shrink, float* acc) {
  constexpr int C = D / 16;
  __m512 o[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c)
      o[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + c * 16), _mm512_set1_ps(shrink[h]));
  for (int j = 0; j < n; ++j) {
    __m512 v[C];
    v_row<S, D>(vpool + slots[j] * stride, v);
    for (int h = 0; h < NH; ++h) {
      const __m512 pj = _mm512_set1_ps(p[h][j]);
      for (int c = 0; c < C; ++c) o[h][c] = _mm512_fmadd_ps(pj, v[c], o[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + h * D + c * 16, o[h][c]);
}

#if defined(__AVX512BF16__)
// A bf16 model's weighted sum of V, two tokens per instruction (vdpbf16ps), into NH query heads
// at once. Tokens 2k and 2k+1's rows are interleaved (unpacklo/hi: the same lane order as v_row's,
// so `in_order` applies), and each head's weights for them are one 32-bit pair of bf16 numbers:
// o += p[2k] v[2k] + p[2k+1] v[2k+1]. Each V row is read and interleaved once for all NH heads --
// the loop above it widens it once per head -- and half as many multiply-adds are issued. The
// weights are rounded to bf16 first, as Hugging Face's bf16 attention rounds its softmax before
// multiplying by V; the sums stay fp32. An odd tile's last pair repeats a valid row (weight 0):
// the pool past a context may hold anything, NaN included.
template <int D, int NH>
static inline void pv_bf16(const c10::BFloat16* vpool, const int64_t* slots, int n, int64_t stride,
                           const uint32_t (*w)[8], const float* shrink, float* acc) {
  constexpr int C = D / 16;
  __m512 o[NH][C];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c)
      o[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + c * 16), _mm512_set1_ps(shrink[h]));
  for (int k = 0; k < (n + 1) / 2; ++k) {
    const c10::BFloat16* a = vpool + slots[2 * k] * stride;
    const c10::BFloat16* b = vpool + slots[std::min(2 * k + 1, n - 1)] * stride;
    __m512bh wk[NH];
    for (int h = 0; h < NH; ++h) wk[h] = (__m512bh)_mm512_set1_epi32(int(w[h][k]));
    for (int c = 0; c < D / 32; ++c) {
      const __m512i ra = _mm512_loadu_si512(a + c * 32), rb = _mm512_loadu_si512(b + c * 32);
      const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(ra, rb);
      const __m512bh hi = (__m512bh)_mm512_unpackhi_epi16(ra, rb);
      for (int h = 0; h < NH; ++h) {
        o[h][2 * c] = _mm512_dpbf16_ps(o[h][2 * c], wk[h], lo);
        o[h][2 * c + 1] = _mm512_dpbf16_ps(o[h][2 * c + 1], wk[h], hi);
      }
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + h * D + c * 16, o[h][c]);
}
#endif

template <typename S, int D>
static inline void in_order(const float* acc, float inv, float* out) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    for (int c = 0; c < D / 32; ++c)
      for (int k = 0; k < 4; ++k)
        for (int e = 0; e < 4; ++e) {
          out[c * 32 + 8 * k + e] = acc[2 * c * 16 + 4 * k + e] * inv;
          out[c * 32 + 8 * k + 4 + e] = acc[(2 * c + 1) * 16 + 4 * k + e] * inv;
        }
  } else {
    for (int d = 0; d < D; ++d) out[d] = acc[d] * inv;
  }
}

#endif  // __AVX512F__
