/* The parallel-loop seam between a platform's thread pool and plugin kernels: plain C, so that
 * two shared libraries built apart (the CPU platform's kernels, a quantization plugin's) agree
 * on it without sharing any C++ type.
 *
 * Why: a plugin kernel's at::parallel_for runs on torch's OpenMP team (or, built without
 * -fopenmp, as load_native_extension builds, on the calling thread alone), while the platform's
 * kernels of the same decode step run on the platform's pool; each pool's idle workers spin
 * for a while after a loop, holding the cores the other pool's next loop needs. One pool for
 * every kernel of a step keeps its workers busy between the kernels instead.
 *
 * A platform that runs its kernels' loops on a pool of its own publishes one
 * tokenmill_parallel_backend (in a PyCapsule named TOKENMILL_PARALLEL_BACKEND_CAPSULE, given to
 * tokenmill.plugin_api.publish_parallel_backend). Every extension built by
 * tokenmill.plugin_api.load_native_extension whose sources include <tokenmill/parallel.h> is then
 * attached to it (its exported tokenmill_parallel_attach is called with the table, whether the
 * extension was imported before the platform published or after), and its tokenmill::parallel_for
 * loops run as the platform's own kernels' loops run.
 *
 * The contract:
 *   - the table, and what it points to, live as long as the process (never unpublished);
 *   - parallel_for(begin, end, grain, call, context) calls call(context, b, e) over disjoint
 *     ranges [b, e) covering [begin, end), each at least `grain` long but the last, on the
 *     platform's threads (the calling one included), and returns 0 once every call returned.
 *     A nonzero return means it made no call (its pool could not start): the caller then runs
 *     the loop itself;
 *   - `call` must not throw (C++ exceptions do not cross this boundary): parallel.h catches a
 *     range's exception and rethrows it in the caller after parallel_for returned;
 *   - a loop started inside another loop's range runs on that thread, as at::parallel_for's.
 */
#ifndef TOKENMILL_PARALLEL_ABI_H
#define TOKENMILL_PARALLEL_ABI_H

#include <stdint.h>

#define TOKENMILL_PARALLEL_ABI_VERSION 1
#define TOKENMILL_PARALLEL_BACKEND_CAPSULE "tokenmill.parallel_backend"

#ifdef __cplusplus
extern "C" {
#endif

typedef void (*tokenmill_parallel_range)(const void* context, int64_t begin, int64_t end);

typedef struct tokenmill_parallel_backend {
  uint32_t abi_version; /* TOKENMILL_PARALLEL_ABI_VERSION; an extension ignores any other */
  uint32_t size;        /* sizeof(tokenmill_parallel_backend): later versions only append */
  int (*parallel_for)(int64_t begin, int64_t end, int64_t grain, tokenmill_parallel_range call,
                      const void* context);
} tokenmill_parallel_backend;

#ifdef __cplusplus
}
#endif

#endif /* TOKENMILL_PARALLEL_ABI_H */
