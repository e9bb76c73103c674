// Prefill (extend) attention for a bf16 model on a bf16 pool, on the CPU's bf16 units. Included
// by paged_decode.cpp, the extension's one source.
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#include "avx512_tiles.h"

#if defined(__AVX512F__)
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
