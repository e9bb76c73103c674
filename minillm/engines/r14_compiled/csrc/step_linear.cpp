// Rung 14: a linear layer on oneDNN's packed weight as one operator of torch's
// (torch.ops.minillm.step_linear), called from a compiled decode step with no Python around it
// (notebook 14, docs/rungs/14_compiled.md).
//
// oneDNN's packed copy of a weight (layers/linear.py) is an opaque tensor the tracer cannot look
// at, so the compiled graph cannot hold it: ops.py's ``packed_linear`` reaches it from Python by
// the layer's index, ~121 calls of the interpreter per SmolLM2 step. Here the runner registers
// its packed weights once (``register_linears``: a table, kept until ``release_linears``), names
// the table for each step on its thread (``set_linears``, as the attention's step context), and
// the operator finds the weight by index and calls oneDNN's own operator
// (mkldnn::_linear_pointwise, the residual as its "add" post-op) through torch's dispatcher.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

struct LinearTable {
  std::vector<torch::Tensor> packed;
  std::vector<c10::optional<torch::Tensor>> bias;
};

static std::mutex tables_lock;
static std::unordered_map<int64_t, std::shared_ptr<const LinearTable>> tables;
static int64_t next_handle = 1;
static thread_local std::shared_ptr<const LinearTable> current;   // this thread's step

int64_t register_linears(std::vector<torch::Tensor> packed,
                         std::vector<c10::optional<torch::Tensor>> bias) {
  TORCH_CHECK(packed.size() == bias.size(), "one bias (or None) per packed weight: ",
              packed.size(), " weights, ", bias.size(), " biases");
  auto table = std::make_shared<LinearTable>(LinearTable{std::move(packed), std::move(bias)});
  std::lock_guard<std::mutex> guard(tables_lock);
  tables[next_handle] = std::move(table);
  return next_handle++;
}

void release_linears(int64_t handle) {
  std::lock_guard<std::mutex> guard(tables_lock);
  tables.erase(handle);    // a step still running on it keeps its own reference
}

void set_linears(int64_t handle) {
  std::lock_guard<std::mutex> guard(tables_lock);
  auto it = tables.find(handle);
  TORCH_CHECK(it != tables.end(), "no table of packed weights ", handle,
              " (released, or never registered)");
  current = it->second;
}

void clear_linears() { current.reset(); }

// x [B, in] -> x @ W.T (+ bias) (+ residual) [B, out_features]
torch::Tensor step_linear(torch::Tensor x, c10::optional<torch::Tensor> residual, int64_t index,
                          int64_t out_features) {
  const std::shared_ptr<const LinearTable> table = current;
  TORCH_CHECK(table, "minillm::step_linear called outside a compiled decode step (no table of "
              "packed weights on this thread)");
  TORCH_CHECK(index >= 0 && index < int64_t(table->packed.size()), "linear ", index,
              " of a table of ", table->packed.size());
  static const auto plain = c10::Dispatcher::singleton().findSchemaOrThrow(
      "mkldnn::_linear_pointwise", "");
  static const auto binary = c10::Dispatcher::singleton().findSchemaOrThrow(
      "mkldnn::_linear_pointwise", "binary");
  torch::jit::Stack stack;
  // boxed calls: the schemas' C++ types (str, Scalar?[]) differ across torch versions
  if (residual.has_value()) {
    stack = {x.contiguous(), residual->contiguous(), table->packed[index], table->bias[index],
             std::string("add")};
    binary.callBoxed(&stack);
  } else {
    stack = {x.contiguous(), table->packed[index], table->bias[index], std::string("none"),
             c10::List<c10::optional<at::Scalar>>(), std::string("")};
    plain.callBoxed(&stack);
  }
  torch::Tensor y = stack[0].toTensor();
  TORCH_CHECK(y.size(-1) == out_features, "linear ", index, " gave ", y.size(-1),
              " features, the graph expected ", out_features);
  return y;
}

// Its schema and its shape function (for the tracer) are declared in Python: ops.py.
TORCH_LIBRARY_IMPL(minillm, CPU, m) { m.impl("step_linear", &step_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("register_linears", &register_linears, "a table of packed weights; returns its handle");
  m.def("release_linears", &release_linears, "forget a table");
  m.def("set_linears", &set_linears, "the table this thread's steps read");
  m.def("clear_linears", &clear_linears, "end of the step");
}
