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
// and each is read once for the query heads of its group (grouped-query attention). Two passes over the context: scores (q . k * scale) into a small
// buffer, then softmax and the weighted sum of V rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
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

template <typename T>
static void dispatch_storage(const torch::Tensor& q, const torch::Tensor& k_cache,
                             const torch::Tensor& v_cache, const float* ks, const float* vs,
                             const torch::Tensor& tables, const torch::Tensor& lens,
                             torch::Tensor& out, double scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = k_cache.size(2), bs = k_cache.size(1);
  auto run = [&](auto tag) {
    using S = decltype(tag);
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
  q = q.contiguous();
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
    dispatch_storage<scalar_t>(q, k_cache, v_cache, ks, vs, tables, lens, out, scale);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention, reading blocks in place (CPU)");
}
