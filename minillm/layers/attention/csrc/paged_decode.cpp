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
// then softmax and the weighted sum of V rows; the AVX-512 path after it makes one. Last, for a
// bf16 model on a bf16 pool, prefill (paged_extend): a prompt chunk's rows, 16 at a time.
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
#include "avx512_tiles.h"

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
      // the g query heads of this KV head, MaxG at a time: their weights first, then one pass
      // over the tile's V rows for all of them (pv_rows: each row read and widened once)
      constexpr int MaxG = D == 64 ? 4 : 2;
      for (int64_t hc = kvh * g; hc < (kvh + 1) * g; hc += MaxG) {
        const int nh = int(std::min<int64_t>(MaxG, (kvh + 1) * g - hc));
        alignas(64) float p[MaxG][16];
        float shrink[MaxG];
        for (int i = 0; i < nh; ++i) {
          const int64_t h = hc + i;
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
          shrink[i] = std::exp(mx[h] - m_new);   // 0 on the first tile
          const __m512 e = _mm512_maskz_mov_ps(valid,
                                               exp16(_mm512_sub_ps(s, _mm512_set1_ps(m_new))));
          sum[h] = sum[h] * shrink[i] + _mm512_reduce_add_ps(e);
          mx[h] = m_new;
          _mm512_store_ps(p[i], Scaled ? _mm512_mul_ps(e, _mm512_loadu_ps(vs)) : e);
        }
        const S* vpool = v_cache + kvh * D;
        float* a = acc + hc * D;
        if (nh == 1) pv_rows<S, D, 1>(vpool, tile.slots, tile.n, stride, p, shrink, a);
        else if (nh == 2) pv_rows<S, D, 2>(vpool, tile.slots, tile.n, stride, p, shrink, a);
        else if constexpr (MaxG == 4) {
          if (nh == 3) pv_rows<S, D, 3>(vpool, tile.slots, tile.n, stride, p, shrink, a);
          else pv_rows<S, D, 4>(vpool, tile.slots, tile.n, stride, p, shrink, a);
        }
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


#include "paged_extend.h"
#include "decode_step.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention, reading blocks in place (CPU)");
  m.def("paged_extend", &paged_extend, "bf16 prefill attention, reading blocks in place (CPU)");
  m.def("extend_in_place", &extend_in_place, "whether paged_extend is built here");
  m.def("set_step_context", &set_step_context, "rung 14: the pools and tables of one decode step");
  m.def("clear_step_context", &clear_step_context, "rung 14: end of the decode step");
}
