// Paged decode attention on the CPU, reading K/V where they sit in the block pools.
//
// The torch reference (attention.py) first copies every sequence's K/V rows out of the pools into
// one padded tensor, then SDPA reads that copy again: per layer and step, each context token's
// K/V is written once and read twice. This kernel follows the block table itself and reads each
// row once -- the same idea as the Triton kernel of rung 4 on a GPU (notebook 04).
//
// A narrower cache (rung 9, notebook 09) is read the same way: each stored row (int8, fp8 or
// 16-bit) is widened to the query's type inside the dot product and the weighted sum, times its
// per-token, per-head scale -- the context is never dequantized into a copy.
//
// One work item = one sequence; a token's K/V rows for all KV heads sit side by side in the pool
// and each is read once for the query heads of its group (grouped-query attention). The portable
// loop just below makes two passes over the context: scores (q . k * scale) into a small buffer,
// then softmax and the weighted sum of V rows; the AVX-512 path after it makes one.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <type_traits>
#include <cmath>
#include <vector>

// T: the query's (compute) type; S: how the pool stores a row (T itself, int8, fp8 or 16 bits).
template <typename T, typename S>
static inline T dot(const T* a, const S* b, int64_t n) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * static_cast<T>(b[i]);
  return s;
}

// k_scale/v_scale: [slots, KVH] fp32, one per stored row, or nullptr (rows stored as they are).
template <typename T, typename S>
static void decode_kernel(const T* q, const S* k_cache, const S* v_cache, const float* k_scale,
                          const float* v_scale, const int32_t* tables,
                          const int32_t* lens, T* out, int64_t B, int64_t H, int64_t KVH,
                          int64_t D, int64_t block_size, int64_t table_width, double scale) {
  const int64_t g = H / KVH;
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> scores;                            // [H, L] for one sequence
    for (int64_t b = begin; b < end; ++b) {
      const int64_t L = lens[b];
      const int32_t* table = tables + b * table_width;
      scores.resize(H * L);
      const T* qb = q + b * H * D;
      // pass 1: scores. A token's K rows for all KV heads are adjacent in the pool: read them once
      // and score every query head against its group's row.
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = int64_t(table[t / block_size]) * block_size + t % block_size;
        const S* krow = k_cache + slot * KVH * D;
        for (int64_t h = 0; h < H; ++h) {
          const T ks = k_scale ? T(k_scale[slot * KVH + h / g]) : T(1);
          scores[h * L + t] = dot(qb + h * D, krow + (h / g) * D, D) * (T(scale) * ks);
        }
      }
      for (int64_t h = 0; h < H; ++h) {               // softmax per query head
        T* s = scores.data() + h * L;
        T m = s[0];
        for (int64_t t = 1; t < L; ++t) m = std::max(m, s[t]);
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < L; ++t) { s[t] = std::exp(s[t] - m); sum += s[t]; }
        const T inv = T(1) / sum;
        for (int64_t t = 0; t < L; ++t) s[t] *= inv;
      }
      T* ob = out + b * H * D;
      std::fill(ob, ob + H * D, T(0));
      for (int64_t t = 0; t < L; ++t) {               // pass 2: weighted sum of V rows
        const int64_t slot = int64_t(table[t / block_size]) * block_size + t % block_size;
        const S* vrow = v_cache + slot * KVH * D;
        for (int64_t h = 0; h < H; ++h) {
          const T p = scores[h * L + t] * (v_scale ? T(v_scale[slot * KVH + h / g]) : T(1));
          const S* v = vrow + (h / g) * D;
          T* o = ob + h * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) o[d] += p * static_cast<T>(v[d]);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// The fast path (AVX-512, fp32 arithmetic): what makes decode attention keep up with bf16 linears.
//
// The loop above spends most of its time outside the multiply-adds: every 64-long dot product
// ends in a horizontal sum, every exp is a scalar call, and a 16-bit pool row is widened one
// element at a time. Here the context is walked once, in tiles of 16 tokens (one block at the
// default block size), with an online softmax (FlashAttention's running max and sum):
//   * a tile's K rows are scored for the g query heads that share them (SmolLM2: 3) as 16
//     vector accumulators and one transposing reduction (reduce16: 45 shuffles/adds for 16
//     sums); a bf16 query against a bf16 pool takes its dot products in place (vdpbf16ps);
//     other 16-bit and int8 rows are widened to fp32 once per tile;
//   * exp is a vector polynomial (exp16); the running max rescales the head's output only when
//     it grows;
//   * the same tile's V rows are then added into the heads' outputs while they are in cache;
//     a bf16 model's are added two tokens per instruction for up to 4 heads at once (pv_bf16).
// One pass instead of two (scores, then V) lets the K and V of one block stream together, and
// the prefetches now reach the machine code (see prefetch_l2). Against the two-pass kernel of
// commit 8f128cf, both built here and called alternately in one process (128 rows, SmolLM2's
// shape, 30 pools read from memory, 2 threads): bf16 1.3-1.45x faster at 155 tokens of context,
// 1.4-1.55x at 600; fp32 1.24x and 1.41x; an int8 pool (rung 9) 1.65-1.74x at 155. The blocks
// sit anywhere in the pool, so the next tiles -- and the next sequence's first ones -- are asked
// for ahead.
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const c10::BFloat16* p) {   // bf16 is fp32's top half: shift it up
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
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

// e^x for x <= 0 (softmax after subtracting the max): 2^n * 2^f, |f| <= 1/2, f's 2^f by its
// Taylor series to degree 6 (relative error ~1e-7, fp32's own), 2^n by vscalefps.
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

#if defined(__AVX512BF16__)
// One tile against the g query heads h0.. of one KV head, for a bf16 query on a bf16 pool: the
// scores in place, the online softmax, then pv_bf16 for up to MaxG heads at a time.
template <int D>
static inline void tile_heads_bf16(const c10::BFloat16* qb, const c10::BFloat16* const* krows,
                                   const c10::BFloat16* vpool, const Tile& tile, __mmask16 valid,
                                   float scale, int64_t h0, int64_t g, int64_t stride, float* mx,
                                   float* sum, float* acc) {
  constexpr int MaxG = D == 64 ? 4 : 2;   // MaxG x D/16 sums and a pair of rows in 32 registers
  for (int64_t hc = h0; hc < h0 + g; hc += MaxG) {
    const int nh = int(std::min<int64_t>(MaxG, h0 + g - hc));
    uint32_t w[MaxG][8];
    float shrink[MaxG];
    for (int i = 0; i < nh; ++i) {
      const int64_t h = hc + i;
      const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY), _mm512_mul_ps(
          scores16_bf16<D>(qb + h * D, krows), _mm512_set1_ps(scale)));
      const float m_new = std::max(mx[h], _mm512_reduce_max_ps(s));
      shrink[i] = std::exp(mx[h] - m_new);   // 0 on the first tile
      const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
      const __m256i e16 = (__m256i)_mm512_cvtneps_pbh(e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w[i]), e16);
      // the sum of the rounded weights: what V is multiplied by, so they still sum to one
      const __m512 er = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(e16), 16));
      sum[h] = sum[h] * shrink[i] + _mm512_reduce_add_ps(er);
      mx[h] = m_new;
    }
    float* a = acc + hc * D;
    if (nh == 1) pv_bf16<D, 1>(vpool, tile.slots, tile.n, stride, w, shrink, a);
    else if (nh == 2) pv_bf16<D, 2>(vpool, tile.slots, tile.n, stride, w, shrink, a);
    else if constexpr (MaxG == 4) {
      if (nh == 3) pv_bf16<D, 3>(vpool, tile.slots, tile.n, stride, w, shrink, a);
      else pv_bf16<D, 4>(vpool, tile.slots, tile.n, stride, w, shrink, a);
    }
  }
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

// Decode attention for one sequence, all heads (see above). q, out: [H, D] fp32 (qb: the same
// query in bf16, or nullptr); state: [H * D + 2H] scratch; buf: [16, D] scratch.
// InPlace: a bf16 query scored against bf16 rows where they sit; Scaled: rows stored with scales.
template <typename S, int D, bool InPlace, bool Scaled>
static void decode_seq(const float* q, const c10::BFloat16* qb, const S* k_cache,
                       const S* v_cache, const float* k_scale, const float* v_scale,
                       const int32_t* table, int64_t L, int64_t H, int64_t KVH,
                       int64_t block_size, float scale, float* out, float* state, float* buf) {
  constexpr int C = D / 16;
  const int64_t g = H / KVH, stride = KVH * D, row_bytes = stride * sizeof(S);
  float* acc = state;                   // [H, D]: the weighted sum of V so far, per head
  float* mx = state + H * D;            // [H]: the largest score so far
  float* sum = mx + H;                  // [H]: the sum of e^(score - mx) so far
  std::fill(acc, acc + H * D, 0.f);
  // finite, not -inf: -ffast-math assumes no infinity reaches std::exp (e^(-1e30 - m) is 0)
  std::fill(mx, mx + H, -1e30f);
  std::fill(sum, sum + H, 0.f);
  const float* rows[16];
  Tile tile;
  for (int64_t t0 = 0; t0 < L; t0 += 16) {
    tile.fill(table, t0, L, block_size);
    const __mmask16 valid = __mmask16((1u << tile.n) - 1);
    for (int64_t kvh = 0; kvh < KVH; ++kvh) {
      prefetch_tile(k_cache, v_cache, table, t0 + 16 * kAhead, L, block_size, row_bytes,
                    kvh * D * int64_t(sizeof(S)), (kvh + 1) * D * int64_t(sizeof(S)));
      float ks[16], vs[16];
      if constexpr (Scaled) {
        for (int j = 0; j < 16; ++j) {
          const int64_t at = tile.slots[std::min(j, tile.n - 1)] * KVH + kvh;
          ks[j] = scale * k_scale[at];
          vs[j] = v_scale[at];
        }
      }
      const __m512 mult = Scaled ? _mm512_loadu_ps(ks) : _mm512_set1_ps(scale);
      const S* kpool = k_cache + kvh * D;
      const S* krows[16];
      if constexpr (InPlace) {
        for (int j = 0; j < 16; ++j) krows[j] = kpool + tile.slots[std::min(j, tile.n - 1)] * stride;
#if defined(__AVX512BF16__)
        tile_heads_bf16<D>(qb, krows, v_cache + kvh * D, tile, valid, scale, kvh * g, g, stride,
                           mx, sum, acc);
        continue;
#endif
      } else {
        tile_rows<S, D>(kpool, tile.slots, tile.n, stride, buf, rows);
      }
      for (int64_t h = kvh * g; h < (kvh + 1) * g; ++h) {
        __m512 raw;
#if defined(__AVX512BF16__)
        if constexpr (InPlace) raw = scores16_bf16<D>(qb + h * D, krows);
        else raw = scores16<D>(q + h * D, rows);
#else
        raw = scores16<D>(q + h * D, rows);   // InPlace needs AVX512-BF16: not built here
#endif
        const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-INFINITY),
                                              _mm512_mul_ps(raw, mult));
        // online softmax: a new largest score shrinks what was summed so far by e^(old - new)
        const float m_new = std::max(mx[h], _mm512_reduce_max_ps(s));
        const float shrink = std::exp(mx[h] - m_new);   // 0 on the first tile
        const __m512 e = _mm512_maskz_mov_ps(valid, exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
        sum[h] = sum[h] * shrink + _mm512_reduce_add_ps(e);
        mx[h] = m_new;
        alignas(64) float p[16];
        _mm512_store_ps(p, e);
        __m512 o[C];
        for (int c = 0; c < C; ++c)
          o[c] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + c * 16), _mm512_set1_ps(shrink));
        for (int j = 0; j < tile.n; ++j) {
          const __m512 pj = _mm512_set1_ps(Scaled ? p[j] * vs[j] : p[j]);
          __m512 v[C];
          v_row<S, D>(v_cache + tile.slots[j] * stride + kvh * D, v);
          for (int c = 0; c < C; ++c) o[c] = _mm512_fmadd_ps(pj, v[c], o[c]);
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + h * D + c * 16, o[c]);
      }
    }
  }
  for (int64_t h = 0; h < H; ++h) in_order<S, D>(acc + h * D, 1.f / sum[h], out + h * D);
}

template <typename S, int D>
static void decode_fast(const float* q, const c10::BFloat16* qb, const S* k_cache, const S* v_cache, const float* k_scale,
                        const float* v_scale, const int32_t* tables, const int32_t* lens,
                        float* out, int64_t B, int64_t H, int64_t KVH, int64_t block_size,
                        int64_t table_width, double scale) {
  const int64_t row_bytes = KVH * D * int64_t(sizeof(S));
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> state(H * D + 2 * H), buf(16 * D);
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t a = 0; a < kAhead && b + 1 < end; ++a) {   // the next sequence's first tiles
        const int32_t* next = tables + (b + 1) * table_width;
        prefetch_tile(k_cache, v_cache, next, 16 * a, lens[b + 1], block_size, row_bytes);
      }
      auto seq = [&](auto in_place, auto scaled) {
        decode_seq<S, D, decltype(in_place)::value, decltype(scaled)::value>(
            q + b * H * D, qb ? qb + b * H * D : nullptr, k_cache, v_cache, k_scale, v_scale,
            tables + b * table_width, lens[b], H, KVH, block_size, float(scale), out + b * H * D,
            state.data(), buf.data());
      };
      using yes = std::true_type;
      using no = std::false_type;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<S, c10::BFloat16>) {
        if (qb && !k_scale) { seq(yes(), no()); continue; }
      }
#endif
      if (k_scale) seq(no(), yes());
      else seq(no(), no());
    }
  });
}

#if defined(__AVX512BF16__)
// ---------------------------------------------------------------------------------------------
// Prefill (extend) for a bf16 model on a bf16 pool: a prompt chunk's queries against its cached
// prefix and itself, causal, read from the pool through the block table. Torch's flash kernel for
// the CPU (the reference's path) reaches ~67 GFLOP/s here in bf16, slower than in fp32; this one
// works on the bf16 units. Work item: one sequence, one KV head, a block of 16 query rows -- their
// g query heads each (SmolLM2: 48 (row, head) pairs) share every K/V tile they read:
//   * a tile's K rows are transposed once into pairs of dims (kt[p][j]: token j's dims 2p, 2p+1),
//     so one row's 16 scores are D/2 vdpbf16ps on broadcast query pairs, with no horizontal sum;
//   * its V rows are interleaved once by token pairs, as in pv_bf16;
//   * each (row, head) then runs decode's online softmax over the keys it may see (position <=
//     its own), weights rounded to bf16 before V, sums in fp32.
constexpr int64_t kMaxGroup = 16;   // query heads per KV head paged_extend takes

template <int D>
static void extend_block(const c10::BFloat16* q, const c10::BFloat16* k_cache,
                         const c10::BFloat16* v_cache, const int32_t* table, int64_t p0,
                         int64_t r0, int nr, int64_t kvh, int64_t g, int64_t H, int64_t KVH,
                         int64_t block_size, float scale, c10::BFloat16* out, float* acc,
                         float* mx) {
  constexpr int P = D / 2, C = D / 16;
  const int64_t stride = KVH * D;
  std::fill(acc, acc + nr * g * D, 0.f);
  std::fill(mx, mx + nr * g, -1e30f);
  __m512 lsum[16 * kMaxGroup];
  for (int64_t ri = 0; ri < nr * g; ++ri) lsum[ri] = _mm512_setzero_ps();
  alignas(64) int32_t kt[P][16];
  alignas(64) float sc[16 * kMaxGroup][16];   // a tile's scores per (row, head)
  alignas(32) int32_t w[16 * kMaxGroup][8];   // its weights, bf16 pairs
  float shrink[16 * kMaxGroup];
  __m512i vlo[8][D / 32], vhi[8][D / 32];
  const int32_t* kbase = reinterpret_cast<const int32_t*>(k_cache);
  const int64_t last = p0 + r0 + nr - 1;           // the block's last row sees keys 0..last
  Tile tile;
  for (int64_t t0 = 0; t0 <= last; t0 += 16) {
    tile.fill(table, t0, last + 1, block_size);
    alignas(64) int32_t off[16];                   // each token's K row, in pairs of bf16
    for (int j = 0; j < 16; ++j)
      off[j] = int32_t((tile.slots[std::min(j, tile.n - 1)] * stride + kvh * D) / 2);
    const __m512i base = _mm512_load_si512(off);
    for (int p = 0; p < P; ++p)
      _mm512_store_si512(kt[p], _mm512_i32gather_epi32(
          _mm512_add_epi32(base, _mm512_set1_epi32(p)), kbase, 4));
    for (int k = 0; k < (tile.n + 1) / 2; ++k) {
      const c10::BFloat16* a = v_cache + tile.slots[2 * k] * stride + kvh * D;
      const c10::BFloat16* b = v_cache + tile.slots[std::min(2 * k + 1, tile.n - 1)] * stride +
                               kvh * D;
      for (int c = 0; c < D / 32; ++c) {
        const __m512i ra = _mm512_loadu_si512(a + c * 32), rb = _mm512_loadu_si512(b + c * 32);
        vlo[k][c] = _mm512_unpacklo_epi16(ra, rb);
        vhi[k][c] = _mm512_unpackhi_epi16(ra, rb);
      }
    }
    // three passes over the block's (row, head) pairs, each pair independent of the others: the
    // scores, the softmax update, the V sum. One pass doing all three per pair waits on each
    // pair's chain of reductions and exps (measured 1.15x torch at 600 tokens that way).
    const int first = int(std::max<int64_t>(0, t0 - (p0 + r0)));   // rows before it see no key
    for (int r = first; r < nr; ++r)
      for (int64_t i = 0; i < g; ++i) {
        const int32_t* qd = reinterpret_cast<const int32_t*>(q + ((r0 + r) * H + kvh * g + i) * D);
        // four chains, so the multiply-adds overlap (named, not an array: an array indexed by
        // p % 4 lived on the stack, a store and a load around every instruction)
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        auto dp = [&](__m512 acc, int p) {
          return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(qd[p]),
                                  (__m512bh)_mm512_load_si512(kt[p]));
        };
        for (int p = 0; p < P; p += 4) {
          s0 = dp(s0, p); s1 = dp(s1, p + 1); s2 = dp(s2, p + 2); s3 = dp(s3, p + 3);
        }
        const int nv = int(std::min<int64_t>(tile.n, p0 + r0 + r - t0 + 1));
        const __m512 raw = _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));
        _mm512_store_ps(sc[r * g + i], _mm512_mask_blend_ps(
            __mmask16((1u << nv) - 1), _mm512_set1_ps(-INFINITY),
            _mm512_mul_ps(raw, _mm512_set1_ps(scale))));
      }
    for (int64_t ri = first * g; ri < nr * g; ++ri) {
      const __m512 x = _mm512_load_ps(sc[ri]);
      // the running max moves on few tiles: only then is there an exp to take and a sum to shrink
      const float tile_max = _mm512_reduce_max_ps(x);
      shrink[ri] = 1.f;
      if (tile_max > mx[ri]) {
        shrink[ri] = std::exp(mx[ri] - tile_max);   // 0 on the first tile
        mx[ri] = tile_max;
      }
      // masked lanes are -inf: their e^ is 0 (exp16 clamps its argument at -100)
      const __m512 e = exp16(_mm512_sub_ps(x, _mm512_set1_ps(mx[ri])));
      const __m256i e16 = (__m256i)_mm512_cvtneps_pbh(
          _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(-1e30f), _CMP_GT_OQ), e));
      _mm256_store_si256(reinterpret_cast<__m256i*>(w[ri]), e16);
      // the sum of the rounded weights, kept per lane: added across lanes once, at the end
      const __m512 er = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(e16), 16));
      lsum[ri] = _mm512_fmadd_ps(lsum[ri], _mm512_set1_ps(shrink[ri]), er);
    }
    for (int r = first; r < nr; ++r) {
      const int pairs = int(std::min<int64_t>(tile.n, p0 + r0 + r - t0 + 1) + 1) / 2;
      for (int64_t i = 0; i < g; ++i) {
        const int64_t ri = r * g + i;
        float* o_acc = acc + ri * D;
        __m512 o[C];
        for (int c = 0; c < C; ++c)
          o[c] = _mm512_loadu_ps(o_acc + c * 16);
        if (shrink[ri] != 1.f)
          for (int c = 0; c < C; ++c) o[c] = _mm512_mul_ps(o[c], _mm512_set1_ps(shrink[ri]));
        for (int k = 0; k < pairs; ++k) {
          const __m512bh wk = (__m512bh)_mm512_set1_epi32(w[ri][k]);
          for (int c = 0; c < D / 32; ++c) {
            o[2 * c] = _mm512_dpbf16_ps(o[2 * c], wk, (__m512bh)vlo[k][c]);
            o[2 * c + 1] = _mm512_dpbf16_ps(o[2 * c + 1], wk, (__m512bh)vhi[k][c]);
          }
        }
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(o_acc + c * 16, o[c]);
      }
    }
  }
  alignas(64) float row[D];
  for (int r = 0; r < nr; ++r)
    for (int64_t i = 0; i < g; ++i) {
      const int64_t ri = r * g + i;
      in_order<c10::BFloat16, D>(acc + ri * D, 1.f / _mm512_reduce_add_ps(lsum[ri]), row);
      c10::BFloat16* dst = out + ((r0 + r) * H + kvh * g + i) * D;
      for (int d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + d)));
    }
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

template <typename T>
static void dispatch_storage(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const float* ks, const float* vs,
                             const torch::Tensor& tables, const torch::Tensor& lens,
                             torch::Tensor& out, double scale, const c10::BFloat16* qb) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), bs = k_cache.size(1);
  auto run = [&](auto tag) {
    using S = decltype(tag);
#if defined(__AVX512F__)
    constexpr bool fast = std::is_same_v<T, float> &&
        (std::is_same_v<S, float> || std::is_same_v<S, c10::BFloat16> ||
         std::is_same_v<S, c10::Half> || std::is_same_v<S, int8_t>);
    if constexpr (fast) {
      auto go = [&](auto d) {
        decode_fast<S, decltype(d)::value>(
            q.data_ptr<float>(), qb, static_cast<const S*>(k_cache.data_ptr()),
            static_cast<const S*>(v_cache.data_ptr()), ks, vs, tables.data_ptr<int32_t>(),
            lens.data_ptr<int32_t>(), out.data_ptr<float>(), B, H, KVH, bs, tables.size(1), scale);
      };
      if (D == 64) return go(std::integral_constant<int, 64>());
      if (D == 128) return go(std::integral_constant<int, 128>());
    }
#endif
    decode_kernel<T, S>(q.data_ptr<T>(), static_cast<const S*>(k_cache.data_ptr()),
                        static_cast<const S*>(v_cache.data_ptr()), ks, vs,
                        tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<T>(),
                        B, H, KVH, D, bs, tables.size(1), scale);
  };
  switch (k_cache.scalar_type()) {
    case at::kFloat: run(float(0)); break;
    case at::kDouble: run(double(0)); break;
    case at::kChar: run(int8_t(0)); break;
    case at::kHalf: run(c10::Half(0.0f)); break;
    case at::kBFloat16: run(c10::BFloat16(0.0f)); break;
    case at::kFloat8_e4m3fn: run(c10::Float8_e4m3fn(0.0f)); break;
    default: TORCH_CHECK(false, "no paged decode for a KV pool of ", k_cache.scalar_type());
  }
}

static const float* scale_ptr(const c10::optional<torch::Tensor>& s, const torch::Tensor& pool) {
  if (!s.has_value()) return nullptr;
  TORCH_CHECK(s->scalar_type() == at::kFloat && s->is_contiguous() &&
                  s->numel() * pool.size(3) == pool.numel(),
              "a scale pool must be contiguous fp32, one scale per stored row");
  return s->data_ptr<float>();
}

// q [B, H, D]; k_cache, v_cache [num_blocks, block_size, KVH, D] in q's type or narrower (with
// k_scale, v_scale [num_blocks, block_size, KVH] fp32 where scaled); block_tables [B, W] int32;
// context_lens [B] int32. Returns [B, H, D].
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           c10::optional<torch::Tensor> k_scale,
                           c10::optional<torch::Tensor> v_scale,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "q must be [B, H, D], caches [N, bs, KVH, D]");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "block_tables and context_lens must be int32");
  // A 16-bit query (a bf16/fp16 model) is computed in fp32, as the torch reference's softmax is;
  // a bf16 one is also handed over as it is, for the bf16 dot products of the fast path.
  const auto q_type = q.scalar_type();
  const torch::Tensor q16 = q_type == at::kBFloat16 ? q.contiguous() : torch::Tensor();
  q = q.to(q_type == at::kDouble ? at::kDouble : at::kFloat).contiguous();
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "KV pools must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), bs = k_cache.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes() &&
              k_cache.scalar_type() == v_cache.scalar_type(),
              "q, k_cache and v_cache do not match in heads, head_dim or dtype");
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "scales for both pools or neither");
  TORCH_CHECK(tables.size(0) == B && lens.size(0) == B, "one block table and length per row of q");
  // A wrong table entry would read outside the pool: check every entry a context uses, once.
  const int32_t* tp = tables.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= tables.size(1) * bs, "context length ", lp[b], " of row ",
                b, " does not fit its block table");
    for (int64_t j = 0; j < (lp[b] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[b * tables.size(1) + j] >= 0 && tp[b * tables.size(1) + j] < k_cache.size(0),
                  "row ", b, " lists block ", tp[b * tables.size(1) + j], ", not in the pool");
  }
  const float* ks = scale_ptr(k_scale, k_cache);
  const float* vs = scale_ptr(v_scale, v_cache);
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "paged_decode", [&] {
    dispatch_storage<scalar_t>(q, k_cache, v_cache, ks, vs, tables, lens, out, scale,
                               q16.defined() ? q16.data_ptr<c10::BFloat16>() : nullptr);
  });
  return out.to(q_type);
}


// Whether paged_extend is built here (AVX512-BF16): else the torch path prefills.
static bool extend_in_place() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// q [T, H, D] bf16: the step's prefill rows, sequence s's at cu_seqlens_q[s] .. [s + 1], its last
// at position context_lens[s] - 1; k_cache, v_cache [N, bs, KVH, D] bf16 holding every one of
// their K/V (this step's already written); block_tables [S, W] int32. Returns [T, H, D] bf16.
torch::Tensor paged_extend(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor cu_seqlens_q,
                           torch::Tensor context_lens, double scale) {
  TORCH_CHECK(extend_in_place(), "paged_extend needs AVX512-BF16, not built here");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.scalar_type() == at::kBFloat16 &&
                  k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "paged_extend takes a bf16 q [T, H, D] and bf16 pools [N, bs, KVH, D]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes(), "KV pools must be contiguous and alike");
  TORCH_CHECK(k_cache.numel() / 2 < (int64_t(1) << 31), "a pool over 2^32 values: gather offsets");
  q = q.contiguous();
  auto tables = block_tables.contiguous();
  auto cu = cu_seqlens_q.to(at::kLong).contiguous();
  auto lens = context_lens.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), bs = k_cache.size(1), S = tables.size(0);
  TORCH_CHECK(H % KVH == 0 && H / KVH <= 16 && k_cache.size(3) == D && (D == 64 || D == 128),
              "paged_extend takes groups of at most 16 query heads per KV head, head_dim 64 or 128");
  TORCH_CHECK(cu.numel() == S + 1 && lens.numel() == S && cu[S].item<int64_t>() == T,
              "one q range and context length per block table, covering q");
  const int64_t* cp = cu.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int32_t* tp = tables.data_ptr<int32_t>();
  struct Item { int64_t s, kvh, r0; };
  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t qlen = cp[s + 1] - cp[s];
    TORCH_CHECK(qlen >= 0 && lp[s] >= qlen && lp[s] <= tables.size(1) * bs,
                "sequence ", s, ": ", qlen, " queries, context ", lp[s], " do not fit its table");
    for (int64_t j = 0; j < (lp[s] + bs - 1) / bs; ++j)
      TORCH_CHECK(tp[s * tables.size(1) + j] >= 0 && tp[s * tables.size(1) + j] < k_cache.size(0),
                  "sequence ", s, " lists block ", tp[s * tables.size(1) + j], ", not in the pool");
    for (int64_t kvh = 0; kvh < KVH; ++kvh)
      for (int64_t r0 = 0; r0 < qlen; r0 += 16) items.push_back({s, kvh, r0});
  }
  auto out = torch::empty_like(q);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  const int64_t g = H / KVH;
  const auto* qp = q.data_ptr<c10::BFloat16>();
  const auto* kp = k_cache.data_ptr<c10::BFloat16>();
  const auto* vp = v_cache.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  // later row blocks see longer contexts: each thread takes every n-th item, not a contiguous run
  const int64_t n = at::get_num_threads(), total = int64_t(items.size());
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(16 * g * D), mx(16 * g);
    for (int64_t t = begin; t < end; ++t)
      for (int64_t it = t; it < total; it += n) {
        const Item& w = items[it];
        const int64_t qlen = cp[w.s + 1] - cp[w.s];
        auto run = [&](auto d) {
          extend_block<decltype(d)::value>(
              qp + cp[w.s] * H * D, kp, vp, tp + w.s * tables.size(1), lp[w.s] - qlen, w.r0,
              int(std::min<int64_t>(16, qlen - w.r0)), w.kvh, g, H, KVH, bs, float(scale),
              op + cp[w.s] * H * D, acc.data(), mx.data());
        };
        if (D == 64) run(std::integral_constant<int, 64>());
        else run(std::integral_constant<int, 128>());
      }
  });
#endif
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention, reading blocks in place (CPU)");
  m.def("paged_extend", &paged_extend, "bf16 prefill attention, reading blocks in place (CPU)");
  m.def("extend_in_place", &extend_in_place, "whether paged_extend is built here");
}
