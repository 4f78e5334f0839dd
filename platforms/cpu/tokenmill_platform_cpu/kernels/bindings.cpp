// The Python module of the CPU platform's kernels (one per .cpp file beside this one).
#include <torch/extension.h>

torch::Tensor paged_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                              torch::Tensor block_table, torch::Tensor token_request,
                              torch::Tensor token_position, double scale, int64_t sliding_window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
void rotary_embedding_(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos_cache,
                       torch::Tensor sin_cache);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Paged attention over a block table (float32)");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (float32)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x; x = rms_norm(residual), in place (float32)");
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :I]) * x[..., I:] (float32)");
  m.def("rotary_embedding_", &rotary_embedding_, "GPT-NeoX rotary embedding of q and k in place (float32)");
}
