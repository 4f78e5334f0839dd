// The Python module of the CPU platform's kernels (one per .cpp file beside this one).
#include <torch/extension.h>

at::Tensor paged_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                              at::Tensor block_table, at::Tensor token_request,
                              at::Tensor token_position, double scale, int64_t sliding_window);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
at::Tensor silu_and_mul(at::Tensor x);
void rotary_embedding_(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache,
                       at::Tensor sin_cache);
at::Tensor temperature_sample(at::Tensor logits, at::Tensor temperature, at::Tensor uniform);
at::Tensor greedy_sample(at::Tensor logits);
at::Tensor small_linear(at::Tensor x, at::Tensor weight, c10::optional<at::Tensor> bias);
std::vector<std::string> small_linear_dtypes();
bool packed_linear_available();
std::vector<std::string> packed_linear_dtypes();
at::Tensor pack_linear_weight(at::Tensor weight);
at::Tensor packed_linear(at::Tensor x, at::Tensor panels, int64_t n, c10::optional<at::Tensor> bias);
void write_kv_cache(at::Tensor key, at::Tensor value, at::Tensor key_cache, at::Tensor value_cache,
                    at::Tensor slot_mapping);
at::Tensor lora_delta_(at::Tensor x, at::Tensor out, at::Tensor lora_a, at::Tensor lora_b_t, at::Tensor token_slots,
                       int64_t num_slots, std::vector<int64_t> slices);
at::Tensor grouped_moe(at::Tensor x, at::Tensor w13, at::Tensor w2, at::Tensor topk_weights, at::Tensor topk_ids,
                       c10::optional<at::Tensor> packed);
at::Tensor routed_moe(at::Tensor x, at::Tensor router_logits, at::Tensor w13, at::Tensor w2, int64_t top_k,
                      bool renormalize, at::Tensor expert_load, c10::optional<at::Tensor> packed);
at::Tensor pack_moe_experts(at::Tensor w13, at::Tensor w2);
std::tuple<at::Tensor, at::Tensor> moe_route(at::Tensor router_logits, int64_t top_k, bool renormalize);
std::vector<std::string> grouped_moe_dtypes();
void bind_step_graph(pybind11::module& m);
void bind_thread_pool(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a block table (float32 or bfloat16)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32 or bfloat16)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual), in place (float32 or bfloat16)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :I]) * x[..., I:] (float32 or bfloat16)");
  m.def("rotary_embedding_", &rotary_embedding_, "GPT-NeoX rotary embedding of q and k in place (float32 or bfloat16)");
  m.def("small_linear", &small_linear, "x @ weight.T (+ bias) for 1-6 rows (float32 or bfloat16)");
  m.def("small_linear_dtypes", &small_linear_dtypes, "The dtypes small_linear has a vector body for");
  m.def("packed_linear_available", &packed_linear_available, "Whether packed_linear has a vector body (AVX-512 or AVX2+FMA)");
  m.def("packed_linear_dtypes", &packed_linear_dtypes, "The weight dtypes pack_linear_weight packs (bfloat16: AVX2 builds)");
  m.def("pack_linear_weight", &pack_linear_weight, "weight [N, K] -> column panels for packed_linear");
  m.def("packed_linear", &packed_linear, "x @ weight.T (+ bias) on packed panels (float32 decode batches; bfloat16 on AVX2)");
  m.def("write_kv_cache", &write_kv_cache, "Copy each token's K and V rows to its cache slot (any dtype)");
  m.def("lora_delta_", &lora_delta_, "out[t] += B_s A_s x[t] by each token's adapter slot, in place (float32)");
  m.def("grouped_moe", &grouped_moe, "A MoE layer's experts for [T, k] routed tokens in one call (float32 or bfloat16)",
        pybind11::arg("x"), pybind11::arg("w13"), pybind11::arg("w2"), pybind11::arg("topk_weights"),
        pybind11::arg("topk_ids"), pybind11::arg("packed") = pybind11::none());
  m.def("routed_moe", &routed_moe, "A MoE layer from its router logits: softmax top-k, expert load, experts",
        pybind11::arg("x"), pybind11::arg("router_logits"), pybind11::arg("w13"), pybind11::arg("w2"),
        pybind11::arg("top_k"), pybind11::arg("renormalize"), pybind11::arg("expert_load"),
        pybind11::arg("packed") = pybind11::none());
  m.def("pack_moe_experts", &pack_moe_experts, "w13, w2 -> the grouped MoE kernel's packed expert tiles (float32 or bfloat16)");
  m.def("moe_route", &moe_route, "Softmax then top-k routing (weights float32, ids int64), optionally renormalised");
  m.def("grouped_moe_dtypes", &grouped_moe_dtypes, "The dtypes grouped_moe has a vector body for");
  bind_step_graph(m);
  bind_thread_pool(m);
  m.def("temperature_sample", &temperature_sample, "Inverse-CDF draw from softmax(logits / t) per row (float32)");
  m.def("greedy_sample", &greedy_sample, "Each row's first maximum, or its first NaN (float32)");
}
