// The kernels' parallel loop: tokenmill::parallel_for, a drop-in for at::parallel_for.
//
// Why not OpenMP's: at::parallel_for gives each of the team's threads one equal slice and ends
// with a barrier, so a region lasts as long as its slowest thread. On a machine that other
// processes share (most CPU inference: beside an application, in a container with neighbours,
// during a build), one of two threads is often descheduled, and every region of the step then
// waits a scheduler time slice (milliseconds) for it: measured at 23x slower than quiet with the
// load average at 5-10, where one thread alone was 4-18x faster than two.
//
// Here a region is cut into a few chunks per thread that the threads claim one at a time, the
// calling thread included, and the caller waits only for chunks that were claimed and are still
// running: a worker that is not scheduled claims nothing, and the caller (and whoever else runs)
// does its share. Quiet, the workers spin briefly between regions (TOKENMILL_CPU_SPIN_US,
// default 200 us) and then sleep, so back-to-back regions of a step start without a wake-up;
// before an op of torch's own in a step graph they are parked at once (park_workers below).
//
// The pool also sees contention first-hand: when the workers keep missing their share of the
// chunks, the other cores are not ours for now. Then one thread is faster than any split (a
// worker descheduled mid-chunk still holds the region), so the contention fallback runs the
// regions on the calling thread alone, and sets torch's own ops (its matmuls and elementwise
// ops between the kernels, OpenMP's) to one thread, until the workers, still sent one region
// in 16 to see, claim their share again (TOKENMILL_CPU_CONTENTION_FALLBACK=0 turns it off).
// Late workers alone do not prove other processes: torch's own OpenMP team spinning after its
// ops also holds them back. So the machine's load confirms a rise first (machine_load.h: other
// processes' runnable tasks against the cores the region leaves free); unconfirmed, it is overruled.
//
// TOKENMILL_CPU_THREAD_POOL=openmp (or set_thread_pool("openmp")) runs at::parallel_for
// instead, to compare.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace tokenmill {

struct Job {
  void (*call)(const void* fn, int64_t begin, int64_t end);
  const void* fn;
  int64_t begin, end, chunk;
  int64_t count;  // chunks
};

bool claim_pool_enabled();
// The threads a region runs on (this one included): TOKENMILL's own count, set by the platform
// from the usable cores, not torch's, which the contention fallback lowers (thread_pool.cpp).
int pool_threads();
// Runs job's chunks on `threads` threads (this one included); returns when all are done and
// rethrows the first exception a chunk raised.
void run_job(const Job& job, int threads);
bool in_pool_job();
// Workers spinning for the next region go to sleep now: the caller is about to run something
// of torch's (OpenMP's team), which needs these cores. A spinning worker holds its core until
// its spin ends (TOKENMILL_CPU_SPIN_US), and an OpenMP region waits that long for its thread
// there: a batch-64 decode step of the 100M model, ~100 such hand-overs between the kernels
// and oneDNN's matmuls, took ~10% longer. The next region wakes them (a futex wake).
void park_workers();

template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  if (!claim_pool_enabled()) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  const int threads = pool_threads();
  const int64_t range = end - begin;
  grain = grain < 1 ? 1 : grain;
  if (threads <= 1 || range <= grain || in_pool_job() || at::in_parallel_region()) {
    f(begin, end);
    return;
  }
  // A few chunks per thread, each at least `grain` long: enough that a thread which is not
  // running leaves its share to the others, few enough that claiming costs nothing.
  constexpr int64_t kChunksPerThread = 4;
  int64_t count = std::min<int64_t>((range + grain - 1) / grain, threads * kChunksPerThread);
  const int64_t chunk = (range + count - 1) / count;
  count = (range + chunk - 1) / chunk;
  const Job job{[](const void* fn, int64_t b, int64_t e) { (*static_cast<const F*>(fn))(b, e); }, &f, begin, end,
                chunk, count};
  run_job(job, threads);
}

}  // namespace tokenmill
