// tokenmill::parallel_for for plugin kernels: at::parallel_for's signature, run on the platform's
// thread pool where a platform published one (parallel_abi.h says why and the contract), else
// at::parallel_for itself (a CUDA machine, a process without the CPU platform's kernels, an
// extension imported some other way).
//
// Include it in the extension's sources and call tokenmill::parallel_for where at::parallel_for
// was; tokenmill.plugin_api.load_native_extension puts this folder on every build's include path
// and attaches each build it imports. Header-only: each extension carries its own copy of the
// slot below (hidden: without it GCC makes an inline variable one process-wide unique symbol, which
// every extension would share), and exports tokenmill_parallel_attach for the attaching.
#pragma once

#include <ATen/Parallel.h>

#include <atomic>
#include <exception>

#include "tokenmill/parallel_abi.h"

namespace tokenmill {
namespace parallel_detail {

__attribute__((visibility("hidden"))) inline std::atomic<const tokenmill_parallel_backend*> backend{nullptr};

template <class F>
struct Loop {
  const F* f;
  std::atomic<bool> failed{false};
  std::exception_ptr error;

  static void run(const void* context, int64_t begin, int64_t end) {
    auto* loop = const_cast<Loop*>(static_cast<const Loop*>(context));
    try {
      (*loop->f)(begin, end);
    } catch (...) {  // kept for the caller: exceptions do not cross into the platform's library
      if (!loop->failed.exchange(true)) loop->error = std::current_exception();
    }
  }
};

}  // namespace parallel_detail

// Whether this extension's loops run on a platform's pool (attached), for tests and logs.
inline bool parallel_backend_attached() { return parallel_detail::backend.load(std::memory_order_acquire) != nullptr; }

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const tokenmill_parallel_backend* pool = parallel_detail::backend.load(std::memory_order_acquire);
  if (pool == nullptr) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  parallel_detail::Loop<F> loop{&f};
  if (pool->parallel_for(begin, end, grain, &parallel_detail::Loop<F>::run, &loop) != 0) {
    f(begin, end);  // the pool ran nothing
    return;
  }
  if (loop.error) std::rethrow_exception(loop.error);
}

}  // namespace tokenmill

// Called by tokenmill.plugin_api (through ctypes) with the platform's table; 0 when attached,
// nonzero when the table's version is not this header's (the extension keeps at::parallel_for).
extern "C" __attribute__((visibility("default"), used)) inline int tokenmill_parallel_attach(
    const tokenmill_parallel_backend* backend) {
  if (backend == nullptr || backend->abi_version != TOKENMILL_PARALLEL_ABI_VERSION ||
      backend->size < sizeof(tokenmill_parallel_backend)) {
    return 1;
  }
  tokenmill::parallel_detail::backend.store(backend, std::memory_order_release);
  return 0;
}
