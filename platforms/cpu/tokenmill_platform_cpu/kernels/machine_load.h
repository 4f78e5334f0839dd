// Whether other processes want this machine's cores now: the contention gauge's second opinion.
//
// The gauge (thread_pool.cpp) sees the workers miss their share of a region's chunks, which is
// what other processes' load does, but also what this process's own threads do: torch's OpenMP
// team spins for milliseconds after each of its ops (libgomp's GOMP_SPINCOUNT), on the cores the
// pool's workers are pinned to, so during the steps of a model whose kernels alternate with
// torch's ops (int8 W8A8: a plugin kernel per linear layer between torch's attention and norms)
// a worker shares its core with a spinning thread of ours and claims late on a quiet machine.
// One thread is then slower than two, so the fallback must not engage for that.
//
// The kernel counts every runnable task of the machine (/proc/loadavg's fourth field); this
// process's own runnable threads (state R in /proc/self/task/*/stat) taken off it leave the
// others'. A snapshot: the caller samples it a few times and takes the least.
#pragma once

#include <algorithm>

namespace tokenmill {

struct MachineLoad {
  int runnable = -1;  // runnable tasks on the machine (-1: /proc could not be read)
  int ours = 0;       // of them, this process's threads (the reading one included)
  int others() const { return runnable < 0 ? -1 : std::max(0, runnable - ours); }
};

MachineLoad machine_load();

// The least of `samples` readings of others(): another process's task that stays runnable is
// in every reading, while a thread of ours changing state between a reading's two reads moves
// that reading by one, either way. -1 where /proc cannot be read.
int others_runnable(int samples);

}  // namespace tokenmill
