// Rung 14's attention: one layer of a compiled decode step as one operator of torch's
// (torch.ops.minillm.decode_step_attention), called from inductor's generated code with no Python
// around it (notebook 14, docs/rungs/14_compiled.md).
//
// Like vLLM's unified_attention, the op takes only what flows through the graph -- this step's
// q, k, v and the layer's index -- and finds the KV pool, the slot of each row's new K/V, the
// block tables and lengths in the step's context. The runner sets that context once per step,
// before the compiled call (set_step_context), and clears it after: a thread's own, as rung 12
// runs forwards on a worker thread. The pool is never an input of the graph, so the compiler has
// no multi-GB tensor to guard, copy or functionalize. Rows past `rows` pad the batch to its
// bucket: their K/V are not written and their outputs are zeros.
#include <cstring>

struct StepContext {
  std::vector<torch::Tensor> k_caches, v_caches;   // per layer, [N, bs, KVH, D]
  torch::Tensor slots, tables, lens;               // [rows] int64, [rows, W] int32, [rows] int32
  int64_t rows = 0;
  double scale = 1.0;
  bool set = false;
};
static thread_local StepContext step_context;

void set_step_context(std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                      torch::Tensor slots, torch::Tensor tables, torch::Tensor lens, int64_t rows,
                      double scale) {
  TORCH_CHECK(k_caches.size() == v_caches.size() && !k_caches.empty(),
              "one K and one V pool per layer");
  for (size_t l = 0; l < k_caches.size(); ++l)
    TORCH_CHECK(k_caches[l].dim() == 4 && k_caches[l].is_contiguous() &&
                    v_caches[l].sizes() == k_caches[l].sizes() && v_caches[l].is_contiguous() &&
                    v_caches[l].scalar_type() == k_caches[l].scalar_type(),
                "layer ", l, ": K and V pools must be contiguous [N, bs, KVH, D] of one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == rows,
              "slot_mapping: ", rows, " int64 slots, one per row");
  TORCH_CHECK(rows >= 1, "a decode step has at least one row, not ", rows);
  step_context = StepContext{std::move(k_caches), std::move(v_caches), slots.contiguous(),
                             tables, lens, rows, scale, true};
}

void clear_step_context() { step_context = StepContext(); }

// src [>= n, KVH, D] -> pool's flat slots[t] for t < n; rows of a wider float type are cast to
// the pool's (a rung 9 pool of 16-bit casts: what its Python write does, kv_quant.py)
static void write_rows(const torch::Tensor& src, torch::Tensor& pool, const int64_t* slots,
                       int64_t n) {
  TORCH_CHECK(src.size(1) == pool.size(2) && src.size(2) == pool.size(3) &&
                  (src.scalar_type() == pool.scalar_type() ||
                   (at::isFloatingType(src.scalar_type()) && (pool.scalar_type() == at::kHalf ||
                                                              pool.scalar_type() == at::kBFloat16))),
              "new K/V rows of ", src.scalar_type(), " ", src.sizes(), " do not fit a pool of ",
              pool.scalar_type(), " ", pool.sizes());
  const torch::Tensor rows = src.narrow(0, 0, n).to(pool.scalar_type()).contiguous();
  const int64_t bytes = pool.size(2) * pool.size(3) * pool.element_size();
  const int64_t capacity = pool.size(0) * pool.size(1);
  char* dst = static_cast<char*>(pool.data_ptr());
  const char* from = static_cast<const char*>(rows.data_ptr());
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < capacity, "slot ", slots[t], " of row ", t,
                " is not in the pool");
    std::memcpy(dst + slots[t] * bytes, from + t * bytes, bytes);
  }
}

// q [B, H, D], k and v [B, KVH, D], B >= the context's rows -> [B, H, D]
torch::Tensor decode_step_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                    int64_t layer) {
  const StepContext& ctx = step_context;
  TORCH_CHECK(ctx.set, "minillm::decode_step_attention called outside a compiled decode step "
              "(no step context on this thread)");
  TORCH_CHECK(layer >= 0 && layer < int64_t(ctx.k_caches.size()), "layer ", layer,
              " of a model with ", ctx.k_caches.size());
  TORCH_CHECK(q.size(0) >= ctx.rows && k.size(0) == q.size(0) && v.size(0) == q.size(0),
              "q, k, v of ", q.size(0), " rows for a step of ", ctx.rows);
  const int64_t n = ctx.rows;
  torch::Tensor kc = ctx.k_caches[layer], vc = ctx.v_caches[layer];
  write_rows(k, kc, ctx.slots.data_ptr<int64_t>(), n);
  write_rows(v, vc, ctx.slots.data_ptr<int64_t>(), n);
  torch::Tensor attn = paged_decode(q.narrow(0, 0, n), kc, vc, c10::nullopt, c10::nullopt,
                                    ctx.tables, ctx.lens, ctx.scale);
  if (n == q.size(0)) return attn;
  torch::Tensor out = torch::zeros_like(q, at::MemoryFormat::Contiguous);
  out.narrow(0, 0, n).copy_(attn);
  return out;
}

// Its schema and its shape function (for the tracer) are declared in Python: ops.py of rung 14.
TORCH_LIBRARY_IMPL(minillm, CPU, m) { m.impl("decode_step_attention", &decode_step_attention); }
