// Which core each of the claiming pool's threads runs on (TOKENMILL_CPU_BIND).
//
// A worker the scheduler may move is moved: off the core whose caches hold its share of the
// weights, onto the core of the thread it is meant to run beside. Pinning each worker to a core of
// its own keeps the threads of a region apart, as vLLM's VLLM_CPU_OMP_THREADS_BIND does for its
// OpenMP threads. The setting:
//
//   auto (default)  the cores of the affinity mask, read when the pool starts (and again in a
//                   forked child, whose pool is its own): the calling thread's core is the first,
//                   worker i gets the (i+1)-th. Pinned only where the region's threads take every
//                   core of the mask. With fewer threads (a cgroup quota below the mask, which the
//                   platform's count already folds in, or fewer threads asked for) nothing is
//                   pinned: a quota is CPU time, not cores, and every container on a host pinning
//                   its threads to the first cores of a shared mask would pile them all there.
//                   A TP rank's mask is already its slice (executor/cpu_binding.py).
//   off             nothing pinned (before binding existed).
//   a list          "0,2" or "0-3,8": thread i on the i-th listed core that is in the mask (the
//                   others are dropped; none left: one thread), pinned whatever the count.
//
// With binding on, a region never runs on more threads than there are cores to bind them to.
//
// The calling thread is never pinned, so "its" core is only the one no worker takes. It is the
// engine's Python thread: Linux threads inherit the affinity of the thread that starts them, so
// pinning it would also pin to its one core every thread it starts afterwards (torch's OpenMP
// team, which runs torch's ops between the kernels; the server's threads; the KV prefault
// thread); and it is the one thread a region cannot finish without (the pool leaves it every
// chunk a descheduled worker did not claim), which, free, the scheduler can move to whichever
// core is idle.
#pragma once

#include <pthread.h>

#include <cstdint>
#include <string>
#include <vector>

namespace tokenmill {

struct BindPlan {
  std::vector<int> mask;   // the cores this thread may run on when the plan was made, ascending
  std::vector<int> cores;  // thread i's core, the caller's first (never pinned); empty: none pinned
  int threads = 1;         // the threads a region runs on, the caller included
};

// The setting as given (TOKENMILL_CPU_BIND or set_thread_binding), read on first use.
std::string thread_binding();
// Validates and sets it ("auto", "off" or a list of cores); a pool re-plans on its next region.
void set_thread_binding(const std::string& setting);
// Bumped by every set_thread_binding, so that a pool sees a new setting.
uint64_t thread_binding_epoch();
// The plan for regions of `threads` threads, from the calling thread's affinity mask now.
BindPlan plan_binding(int threads);
// Pins `thread` to `core`, or (core < 0) lets it run anywhere in `mask`; whether the OS agreed.
bool pin_thread(pthread_t thread, int core, const std::vector<int>& mask);

}  // namespace tokenmill
