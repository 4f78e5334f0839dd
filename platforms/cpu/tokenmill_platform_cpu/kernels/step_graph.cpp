// A step graph: the kernel calls of one model forward, recorded as they run and
// replayed later from C++ on the same buffers, with no Python in between (the
// CPU counterpart of a CUDA graph). At batch 1 a decode forward is ~100 kernel
// calls of a few microseconds of work each; making them from Python (module
// calls, the layer-ops seam, argument parsing) cost ~1 ms of a ~7 ms step.
//
// Each method has the name and arguments of the kernel it stands for: while a
// forward is captured the platform hands this object to the layer ops and the
// attention backend in place of the kernels module. A method runs its kernel at
// once (the capture is a real step), into an output buffer, and keeps a closure
// that reruns it into that same buffer. The closures hold their tensors, so
// inputs, buffers, weights and caches live as long as the graph; a replay sees
// whatever the caller wrote into the input tensors since.
//
// The graphs of one model runner (one per decode batch size) never run at once,
// so they share their buffers: the n-th output of every graph is a view of the
// pool's n-th slot, sized for the largest batch. All batch sizes up to 64 then
// cost what the graph of 64 alone would (tiny model: ~16 MB) instead of ~30
// times that.
//
// Kernels that are not the platform's (a quantization plugin's, registered with
// TORCH_LIBRARY) are recorded through their `out` overload: `call_out` finds
// `ns::name.out` in torch's dispatcher, matches the Python arguments to its schema
// once, and each replay calls it boxed on a copy of that argument stack (the
// tensors shared, not copied), into pooled buffers given as its out arguments.
#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "thread_pool.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

void small_linear_out(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                      at::Tensor& out);
void packed_linear_out(const at::Tensor& x, const at::Tensor& panels, int64_t n, const c10::optional<at::Tensor>& bias,
                       at::Tensor& out);
void rms_norm_out(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void silu_and_mul_out(const at::Tensor& x, at::Tensor& out);
void rotary_embedding_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache, at::Tensor sin_cache);
void paged_attention_out(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                         const at::Tensor& block_table, const at::Tensor& token_request,
                         const at::Tensor& token_position, double scale, int64_t sliding_window, at::Tensor& out);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                    at::Tensor slot_mapping);
void lora_delta_out(const at::Tensor& x, at::Tensor& out, const at::Tensor& lora_a, const at::Tensor& lora_b_t,
                    const at::Tensor& token_slots, int64_t num_slots, const std::vector<int64_t>& slices);
void routed_moe_out(const at::Tensor& x, const at::Tensor& router_logits, const at::Tensor& w13, const at::Tensor& w2,
                    int64_t top_k, bool renormalize, at::Tensor& expert_load, const at::Tensor& packed,
                    at::Tensor& out);

class GraphPool {
 public:
  explicit GraphPool(int64_t max_rows) : max_rows_(max_rows) {}

  // A buffer of the given shape for a graph of `rows` rows, in the slot of the graph's
  // index-th output; a slot too small (or of another dtype) is replaced, and graphs
  // holding the old one keep it.
  at::Tensor take(size_t index, at::IntArrayRef sizes, const at::TensorOptions& options, int64_t rows) {
    const int64_t numel = c10::multiply_integers(sizes);
    if (index >= slots_.size()) slots_.resize(index + 1);
    auto& slot = slots_[index];
    if (!slot.defined() || slot.scalar_type() != c10::typeMetaToScalarType(options.dtype()) ||
        slot.numel() < numel) {
      const int64_t per_row = rows > 0 ? (numel + rows - 1) / rows : numel;
      slot = at::empty({std::max(numel, per_row * max_rows_)}, options);
    }
    return slot.narrow(0, 0, numel).view(sizes);
  }

 private:
  int64_t max_rows_;
  std::vector<at::Tensor> slots_;
};

class StepGraph {
 public:
  StepGraph(std::shared_ptr<GraphPool> pool, int64_t rows) : pool_(std::move(pool)), rows_(rows) {}

  at::Tensor small_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_linear: x [M, K], weight [N, K]");
    auto out = buffer({x.size(0), weight.size(0)}, x.options());
    return record("small_linear", [=]() mutable { small_linear_out(x, weight, bias, out); }, out);
  }

  at::Tensor packed_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(x.dim() == 2, "packed_linear: x [M, K]");
    auto out = buffer({x.size(0), n}, x.options());
    return record("packed_linear", [=]() mutable { packed_linear_out(x, panels, n, bias, out); }, out);
  }

  at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
    auto out = buffer(x.sizes(), x.options());
    return record("rms_norm", [=]() mutable { rms_norm_out(x, weight, eps, out); }, out);
  }

  at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
    return record("add_rms_norm_", [=]() { ::add_rms_norm_(x, residual, weight, eps); }, x);
  }

  at::Tensor silu_and_mul(at::Tensor x) {
    TORCH_CHECK(x.dim() >= 1, "silu_and_mul: x must have a last dimension");
    auto sizes = x.sizes().vec();
    sizes.back() /= 2;
    auto out = buffer(sizes, x.options());
    return record("silu_and_mul", [=]() mutable { silu_and_mul_out(x, out); }, out);
  }

  void rotary_embedding_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache,
                         at::Tensor sin_cache) {
    record("rotary_embedding_", [=]() { ::rotary_embedding_(positions, q, k, cos_cache, sin_cache); });
  }

  at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache, at::Tensor block_table,
                             at::Tensor token_request, at::Tensor token_position, double scale,
                             int64_t sliding_window) {
    auto out = buffer(query.sizes(), query.options());
    return record("paged_attention", [=]() mutable {
      paged_attention_out(query, key_cache, value_cache, block_table, token_request, token_position, scale,
                          sliding_window, out);
    }, out);
  }

  void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                      at::Tensor slot_mapping) {
    record("write_kv_cache", [=]() { ::write_kv_cache(key, value, key_cache, value_cache, slot_mapping); });
  }

  // LoRA's delta added into a linear layer's output, in place (lora_delta.cpp); each replay
  // reads the adapter slots the caller wrote into token_slots since.
  at::Tensor lora_delta_(at::Tensor x, at::Tensor out, at::Tensor lora_a, at::Tensor lora_b_t, at::Tensor token_slots,
                         int64_t num_slots, std::vector<int64_t> slices) {
    return record("lora_delta_", [=]() mutable {
      lora_delta_out(x, out, lora_a, lora_b_t, token_slots, num_slots, slices);
    }, out);
  }

  // A whole MoE layer from its router logits (grouped_moe.cpp): each replay routes the tokens
  // anew and adds their pairs to expert_load.
  at::Tensor routed_moe(at::Tensor x, at::Tensor router_logits, at::Tensor w13, at::Tensor w2, int64_t top_k,
                        bool renormalize, at::Tensor expert_load, c10::optional<at::Tensor> packed) {
    auto out = buffer(x.sizes(), x.options());
    const at::Tensor panels = packed.value_or(at::Tensor());
    return record("routed_moe", [=]() mutable {
      routed_moe_out(x, router_logits, w13, w2, top_k, renormalize, expert_load, panels, out);
    }, out);
  }

  // The token embedding lookup (torch's embedding op, which the capture lowers to this).
  at::Tensor embedding(at::Tensor weight, at::Tensor ids) {
    TORCH_CHECK(weight.dim() == 2 && ids.dim() == 1, "embedding: weight [V, H] and ids [T]");
    auto out = buffer({ids.size(0), weight.size(1)}, weight.options());
    return record_torch("embedding", [=]() mutable { at::index_select_out(out, weight, 0, ids); }, out);
  }

  // torch's linear (which the capture lowers to this): matmuls the kernels above do not
  // take, such as bfloat16 decode batches past six rows, which torch runs on oneDNN.
  at::Tensor linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias) {
    TORCH_CHECK(x.dim() >= 1 && weight.dim() == 2, "linear: x [..., K], weight [N, K]");
    auto sizes = x.sizes().vec();
    sizes.back() = weight.size(0);
    auto out = buffer(sizes, x.options());
    return record_torch("linear", [=]() mutable { at::linear_out(out, x, weight, bias); }, out);
  }

  // torch.cat (which the capture lowers to this): the outputs of a merged layer whose parts
  // multiply differently (GGUF shards of different block types), joined along `dim`.
  at::Tensor cat(std::vector<at::Tensor> tensors, int64_t dim) {
    TORCH_CHECK(!tensors.empty(), "cat: no tensors");
    auto sizes = tensors[0].sizes().vec();
    const int64_t axis = c10::maybe_wrap_dim(dim, static_cast<int64_t>(sizes.size()));
    sizes[axis] = 0;
    for (const auto& t : tensors) sizes[axis] += t.size(axis);
    auto out = buffer(sizes, tensors[0].options());
    return record_torch("cat", [=]() mutable { at::cat_out(out, tensors, axis); }, out);
  }

  // A contiguous copy (torch's contiguous and clone, which the capture lowers to this).
  at::Tensor contiguous(at::Tensor x) {
    auto out = buffer(x.sizes(), x.options());
    return record_torch("contiguous", [=]() mutable { out.copy_(x); }, out);
  }

  // A pooled buffer of `like`'s shape and dtype (contiguous), for an out overload to write into.
  at::Tensor buffer_like(at::Tensor like) { return buffer(like.sizes(), like.options()); }

  // A call of the registered op `name` (`ns::op`) by its overload `overload` (an out overload,
  // whose out arguments the caller passes in `kwargs` as buffers from buffer_like): run now and
  // on each replay, boxed through the dispatcher, with no Python in between.
  void call_out(const std::string& name, const std::string& overload, pybind11::tuple args, pybind11::dict kwargs) {
    const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const torch::jit::Stack arguments = torch::jit::createStackForSchema(
        op.schema(), args, pybind11::reinterpret_borrow<pybind11::kwargs>(kwargs), std::nullopt);
    record(name + "." + overload, [op, arguments]() {
      torch::jit::Stack stack = arguments;  // callBoxed consumes its stack
      op.callBoxed(stack);
    });
  }

  void replay() {
    for (auto& op : ops_) op();
  }

  // One replay, timing each call: (kernel name, seconds) in order. For finding where a step's time goes.
  std::vector<std::pair<std::string, double>> profile() {
    std::vector<std::pair<std::string, double>> times;
    times.reserve(ops_.size());
    for (size_t i = 0; i < ops_.size(); ++i) {
      const auto start = std::chrono::steady_clock::now();
      ops_[i]();
      const std::chrono::duration<double> elapsed = std::chrono::steady_clock::now() - start;
      times.emplace_back(names_[i], elapsed.count());
    }
    return times;
  }

  int64_t size() const { return static_cast<int64_t>(ops_.size()); }

 private:
  template <typename Op>
  void record(std::string name, Op op) {
    op();
    ops_.emplace_back(std::move(op));
    names_.emplace_back(std::move(name));
  }

  template <typename Op>
  at::Tensor record(const char* name, Op op, at::Tensor out) {
    record(name, std::move(op));
    return out;
  }

  // An op of torch's own, which runs on OpenMP's team rather than the kernels' pool: the pool's
  // spinning workers are parked first, so that the team gets the cores (tokenmill::park_workers).
  template <typename Op>
  at::Tensor record_torch(const char* name, Op op, at::Tensor out) {
    return record(name, [op]() mutable {
      tokenmill::park_workers();
      op();
    }, out);
  }

  at::Tensor buffer(at::IntArrayRef sizes, const at::TensorOptions& options) {
    return pool_->take(buffers_++, sizes, options, rows_);
  }

  std::shared_ptr<GraphPool> pool_;
  int64_t rows_;
  size_t buffers_ = 0;
  std::vector<std::function<void()>> ops_;
  std::vector<std::string> names_;  // each op's kernel, for profile()
};

void bind_step_graph(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<GraphPool, std::shared_ptr<GraphPool>>(m, "GraphPool", "Buffers shared by step graphs that never run at once")
      .def(py::init<int64_t>(), py::arg("max_rows"));
  py::class_<StepGraph>(m, "StepGraph", "Kernel calls recorded as they run, replayed from C++ on the same buffers")
      .def(py::init<std::shared_ptr<GraphPool>, int64_t>(), py::arg("pool"), py::arg("rows"))
      .def("small_linear", &StepGraph::small_linear)
      .def("packed_linear", &StepGraph::packed_linear)
      .def("rms_norm", &StepGraph::rms_norm)
      .def("add_rms_norm_", &StepGraph::add_rms_norm_)
      .def("silu_and_mul", &StepGraph::silu_and_mul)
      .def("rotary_embedding_", &StepGraph::rotary_embedding_)
      .def("paged_attention", &StepGraph::paged_attention)
      .def("write_kv_cache", &StepGraph::write_kv_cache)
      .def("lora_delta_", &StepGraph::lora_delta_)
      .def("routed_moe", &StepGraph::routed_moe, pybind11::arg("x"), pybind11::arg("router_logits"),
           pybind11::arg("w13"), pybind11::arg("w2"), pybind11::arg("top_k"), pybind11::arg("renormalize"),
           pybind11::arg("expert_load"), pybind11::arg("packed") = pybind11::none())
      .def("embedding", &StepGraph::embedding)
      .def("contiguous", &StepGraph::contiguous)
      .def("cat", &StepGraph::cat)
      .def("linear", &StepGraph::linear)
      .def("buffer_like", &StepGraph::buffer_like)
      .def("call_out", &StepGraph::call_out)
      .def("replay", &StepGraph::replay, py::call_guard<py::gil_scoped_release>())
      .def("profile", &StepGraph::profile, py::call_guard<py::gil_scoped_release>())
      .def("__len__", &StepGraph::size);
}
