// The claiming thread pool behind tokenmill::parallel_for (see thread_pool.h for why).
//
// One 64-bit word holds the current job's generation (32 bits), its chunk count (16) and the
// next unclaimed chunk (16); a thread claims a chunk by a compare-and-swap on it, so a claim is
// valid only for the job it read, and the job's description (written before the word) stays
// unchanged until every valid claim of it has finished.
//
// Each worker is pinned to a core of its own when it starts, and again when the binding's plan
// changes (thread_binding.h: TOKENMILL_CPU_BIND, the platform's thread count); a region runs on
// the plan's threads, and workers beyond them (started under an earlier plan) claim nothing.
#include "thread_pool.h"

#include <pybind11/pybind11.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "machine_load.h"
#include "thread_binding.h"
#include "tokenmill/parallel_abi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define TOKENMILL_PAUSE() _mm_pause()
#else
#define TOKENMILL_PAUSE() std::this_thread::yield()
#endif

namespace tokenmill {
namespace {

constexpr uint64_t kIndexMask = 0xffff;
constexpr int64_t kMaxChunks = 0xffff;

uint32_t generation_of(uint64_t word) { return static_cast<uint32_t>(word >> 32); }
int64_t count_of(uint64_t word) { return static_cast<int64_t>((word >> 16) & kIndexMask); }
int64_t next_of(uint64_t word) { return static_cast<int64_t>(word & kIndexMask); }

thread_local bool running_chunk = false;

std::chrono::nanoseconds spin_time() {
  const char* configured = std::getenv("TOKENMILL_CPU_SPIN_US");
  const long micros = configured != nullptr ? std::strtol(configured, nullptr, 10) : 200;
  return std::chrono::microseconds(std::max(0L, micros));
}

std::atomic<int> pool_mode{-1};  // -1 unread, 0 openmp, 1 claim
std::atomic<int64_t> plugin_loops{0};  // loops of plugin kernels run through the published backend
std::atomic<int> configured_threads{0};  // 0: torch's count, read on first use
std::atomic<uint32_t> park_requests{0};  // park_workers calls: a spinning worker that sees one sleeps

bool fallback_enabled() {
  const char* configured = std::getenv("TOKENMILL_CPU_CONTENTION_FALLBACK");
  return configured == nullptr || std::strcmp(configured, "0") != 0;
}

// Whether the workers get their share of the chunks: a running average of the caller's share
// over the regions cut finely enough to tell (a few chunks per thread). Quiet, the caller runs
// about 1/threads of them; when the other cores are busy with other processes, the workers
// are seldom running and the caller runs nearly all. Two thresholds, so that it does not flap.
// A rise the machine's load does not bear out (this process's own threads held the workers
// back: machine_load.h) is overruled: the average starts again from fair after a pause.
class ContentionGauge {
 public:
  // +1 when contention begins, -1 when it ends, else 0.
  int observe(double caller_share, int threads) {
    const double fair = 1.0 / threads;
    if (average_ < 0) average_ = fair;
    if (paused_ > 0) {
      --paused_;
      return 0;
    }
    average_ += (caller_share - average_) / kRegions;
    if (!contended_ && average_ > fair + 0.6 * (1 - fair)) {
      contended_ = true;
      return +1;
    }
    if (contended_ && average_ < fair + 0.15 * (1 - fair)) {
      contended_ = false;
      return -1;
    }
    return 0;
  }
  // The +1 just returned stands not: uncontended, the average back at fair, and the next
  // kPauseRegions regions not counted (each overruling reads /proc: a few hundred us).
  void overrule(int threads) {
    contended_ = false;
    average_ = 1.0 / threads;
    paused_ = kPauseRegions;
  }
  bool contended() const { return contended_; }
  double average() const { return average_; }

 private:
  static constexpr double kRegions = 64;  // regions the average spans, about
  static constexpr int kPauseRegions = 1024;
  double average_ = -1;
  bool contended_ = false;
  int paused_ = 0;
};

class ClaimPool {
 public:
  ClaimPool() : owner_(getpid()), spin_(spin_time()) {}
  ClaimPool(const ClaimPool&) = delete;
  ClaimPool& operator=(const ClaimPool&) = delete;

  pid_t owner() const { return owner_; }
  int workers() const { return static_cast<int>(handles_.size()); }

  void run(const Job& job, int threads) {
    std::lock_guard<std::mutex> one_caller(caller_);  // two engines' threads stepping at once take turns
    threads = bound_threads(threads);
    if (threads <= 1) {  // binding left one core
      job.call(job.fn, job.begin, job.end);
      return;
    }
    if (gauge_.contended() && ++since_probe_ < kProbeEvery) {
      // the other cores are busy with other processes: one thread does it all, as torch does
      // meanwhile, but every kProbeEvery-th region still goes to the workers, to see when they
      // are back
      job.call(job.fn, job.begin, job.end);
      return;
    }
    since_probe_ = 0;
    grow(threads - 1);
    job_ = job;
    active_workers_.store(threads - 1, std::memory_order_relaxed);  // published with the word, as job_
    error_ = nullptr;
    done_.store(0, std::memory_order_relaxed);
    const uint32_t generation = ++generation_;
    word_.store(static_cast<uint64_t>(generation) << 32 | static_cast<uint64_t>(job.count) << 16,
                std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_);
      wake_.notify_all();
    }
    const int64_t mine = work(generation);
    wait_for_claimed_chunks(job.count);
    if (job.count >= 2 * threads) observe(static_cast<double>(mine) / job.count, threads);
    if (error_) std::rethrow_exception(error_);
  }

  // One region's caller share into the gauge; torch's threads follow its verdict, once the
  // machine's load confirms it. Called on the thread that steps the engine, whose OpenMP thread
  // count torch's ops use.
  void observe(double caller_share, int threads) {
    if (!fallback_) return;
    const int change = gauge_.observe(caller_share, threads);
    if (change > 0 && !others_want_our_cores(threads)) {
      gauge_.overrule(threads);
      ++overruled_;
    } else if (change > 0) {
      torch_threads_ = at::get_num_threads();
      at::set_num_threads(1);
      ++engagements_;
    } else if (change < 0 && torch_threads_ > 0) {
      at::set_num_threads(torch_threads_);
    }
  }

  pybind11::dict stats() {
    std::lock_guard<std::mutex> one_caller(caller_);
    bound_threads(pool_threads());  // the plan the next region gets (a bad TOKENMILL_CPU_BIND raises here)
    pybind11::dict out;
    out["workers"] = workers();
    out["contended"] = gauge_.contended();
    out["caller_share"] = gauge_.average();
    out["engagements"] = engagements_;
    out["overruled"] = overruled_;
    out["others_runnable"] = others_runnable_;
    out["fallback"] = fallback_;
    out["threads"] = plan_.threads;
    out["binding"] = thread_binding();
    out["mask"] = as_list(plan_.mask);
    out["cores"] = as_list(plan_.cores);
    out["worker_cores"] = as_list(worker_cores_);
    out["worker_tids"] = as_list(worker_tids_);
    out["plugin_loops"] = plugin_loops.load(std::memory_order_relaxed);
    out["sleeping"] = sleepers_.load(std::memory_order_relaxed);
    return out;
  }

 private:
  // Whether more of other processes' tasks are runnable than there are cores in the mask beside
  // the region's threads: then a worker waits for a core because of them. Where /proc cannot
  // be read, the gauge alone decides (yes).
  bool others_want_our_cores(int threads) {
    constexpr int kSamples = 3;
    others_runnable_ = others_runnable(kSamples);
    const int spare_cores = std::max(0, static_cast<int>(plan_.mask.size()) - threads);
    return others_runnable_ < 0 || others_runnable_ > spare_cores;
  }

  template <class T>
  static pybind11::list as_list(const std::vector<T>& values) {
    pybind11::list out;
    for (const T& value : values) out.append(value);
    return out;
  }

  // The threads a region runs on under the binding (thread_binding.h): planned again, and the
  // workers pinned again, when the setting or the platform's count changed since the last plan.
  int bound_threads(int threads) {
    const uint64_t epoch = thread_binding_epoch();
    if (epoch != plan_epoch_ || threads != planned_for_) {
      plan_ = plan_binding(threads);
      plan_epoch_ = epoch;
      planned_for_ = threads;
      for (int index = 0; index < workers(); ++index) pin_worker(index);
    }
    return plan_.threads;
  }

  // Worker `index` is thread index + 1 of a region (the caller is thread 0).
  void pin_worker(int index) {
    const size_t thread = static_cast<size_t>(index) + 1;
    const int core = thread < plan_.cores.size() ? plan_.cores[thread] : -1;
    const bool pinned = pin_thread(handles_[index], core, plan_.mask);
    worker_cores_[index] = pinned && core >= 0 ? core : -1;
  }

  void grow(int wanted) {
    while (workers() < wanted) {
      const int index = workers();
      std::promise<int64_t> started;
      std::future<int64_t> tid = started.get_future();
      std::thread worker([this, index, seen = generation_, started = std::move(started)]() mutable {
        started.set_value(static_cast<int64_t>(syscall(SYS_gettid)));
        worker_loop(index, seen);
      });
      handles_.push_back(worker.native_handle());
      worker.detach();  // lives as long as the process; never joined at exit
      worker_tids_.push_back(tid.get());  // the kernel's id of it, for /proc/self/task/<tid>
      worker_cores_.push_back(-1);
      pin_worker(index);
    }
  }

  // Claims and runs chunks of `generation` until none is left (or a newer job replaced it);
  // returns how many this thread ran.
  int64_t work(uint32_t generation) {
    int64_t ran = 0;
    uint64_t word = word_.load(std::memory_order_acquire);
    while (generation_of(word) == generation && next_of(word) < count_of(word)) {
      if (!word_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        continue;  // `word` now holds the current value
      }
      run_chunk(next_of(word));
      ++ran;
      word = word_.load(std::memory_order_acquire);
    }
    return ran;
  }

  void run_chunk(int64_t index) {
    const int64_t begin = job_.begin + index * job_.chunk;
    const int64_t end = std::min(job_.end, begin + job_.chunk);
    running_chunk = true;
    try {
      job_.call(job_.fn, begin, end);
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_lock_);
      if (!error_) error_ = std::current_exception();
    }
    running_chunk = false;
    done_.fetch_add(1, std::memory_order_acq_rel);
  }

  void wait_for_claimed_chunks(int64_t count) {
    for (int spins = 0; done_.load(std::memory_order_acquire) < count; ++spins) {
      // a claimed chunk's thread may share this core: after a short spin, let it run
      if (spins < 4096) {
        TOKENMILL_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
  }

  // `seen`: the last job posted before this worker started.
  void worker_loop(int index, uint32_t seen) {
    for (;;) {
      const uint32_t generation = wait_for_job(seen);
      if (index < active_workers_.load(std::memory_order_relaxed)) work(generation);  // else: binding's spare
      seen = generation;
    }
  }

  // The generation of a job newer than `seen`: spun for briefly, then slept for.
  uint32_t wait_for_job(uint32_t seen) {
    const auto until = std::chrono::steady_clock::now() + spin_;
    const uint32_t parked = park_requests.load(std::memory_order_relaxed);
    for (int spins = 0;; ++spins) {
      const uint32_t generation = generation_of(word_.load(std::memory_order_acquire));
      if (generation != seen) return generation;
      TOKENMILL_PAUSE();
      if ((spins & 63) == 63 && (std::chrono::steady_clock::now() >= until ||
                                 park_requests.load(std::memory_order_relaxed) != parked))
        break;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    std::unique_lock<std::mutex> lock(sleep_);
    wake_.wait(lock, [&] { return generation_of(word_.load(std::memory_order_seq_cst)) != seen; });
    sleepers_.fetch_sub(1, std::memory_order_relaxed);
    return generation_of(word_.load(std::memory_order_acquire));
  }

  const pid_t owner_;
  const std::chrono::nanoseconds spin_;
  const bool fallback_ = fallback_enabled();
  ContentionGauge gauge_;
  int torch_threads_ = 0;  // torch's threads before the fallback set them to one
  int64_t engagements_ = 0;
  int64_t overruled_ = 0;  // rises of the gauge the machine's load did not confirm
  int others_runnable_ = -1;  // other processes' runnable tasks when the gauge last rose
  static constexpr int kProbeEvery = 16;  // while contended: regions per region run on the pool
  int since_probe_ = 0;
  BindPlan plan_;
  uint64_t plan_epoch_ = std::numeric_limits<uint64_t>::max();  // none yet
  int planned_for_ = -1;
  std::vector<pthread_t> handles_;  // the workers, detached
  std::vector<int64_t> worker_tids_;
  std::vector<int> worker_cores_;  // -1: not pinned
  std::atomic<int> active_workers_{0};  // the current region's workers: the first ones
  std::mutex caller_;
  Job job_{};
  uint32_t generation_ = 0;
  std::atomic<uint64_t> word_{0};
  std::atomic<int64_t> done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex sleep_;
  std::condition_variable wake_;
  std::mutex error_lock_;
  std::exception_ptr error_;
};

std::mutex pool_lock;
ClaimPool* pool = nullptr;  // never freed: its detached workers outlive static destruction

// This process's pool; a forked child gets a new one (its parent's workers did not fork with it).
ClaimPool& current_pool() {
  std::lock_guard<std::mutex> lock(pool_lock);
  if (pool == nullptr || pool->owner() != getpid()) pool = new ClaimPool();
  return *pool;
}

}  // namespace

bool claim_pool_enabled() {
  int mode = pool_mode.load(std::memory_order_relaxed);
  if (mode < 0) {
    const char* configured = std::getenv("TOKENMILL_CPU_THREAD_POOL");
    mode = configured != nullptr && std::strcmp(configured, "openmp") == 0 ? 0 : 1;
    pool_mode.store(mode, std::memory_order_relaxed);
  }
  return mode == 1;
}

bool in_pool_job() { return running_chunk; }

void park_workers() { park_requests.fetch_add(1, std::memory_order_relaxed); }

int pool_threads() {
  int threads = configured_threads.load(std::memory_order_relaxed);
  if (threads <= 0) {
    threads = at::get_num_threads();
    configured_threads.store(threads, std::memory_order_relaxed);
  }
  return threads;
}

void run_job(const Job& job, int threads) {
  if (job.count > kMaxChunks) {  // not reached: chunks are capped at a few per thread
    job.call(job.fn, job.begin, job.end);
    return;
  }
  current_pool().run(job, threads);
}

namespace {

// The parallel-loop seam's entry (tokenmill/parallel_abi.h): a plugin kernel's loop runs as the
// platform's own kernels' loops do (this pool, or OpenMP under TOKENMILL_CPU_THREAD_POOL=openmp).
// `call` does not throw, so an exception here came before any range ran: nonzero, and the
// plugin runs the loop itself.
int plugin_parallel_for(int64_t begin, int64_t end, int64_t grain, tokenmill_parallel_range call,
                        const void* context) {
  try {
    parallel_for(begin, end, grain, [&](int64_t b, int64_t e) { call(context, b, e); });
  } catch (...) {
    return 1;
  }
  plugin_loops.fetch_add(1, std::memory_order_relaxed);
  return 0;
}

const tokenmill_parallel_backend published_backend{TOKENMILL_PARALLEL_ABI_VERSION, sizeof(tokenmill_parallel_backend),
                                                   &plugin_parallel_for};

}  // namespace
}  // namespace tokenmill

void bind_thread_pool(pybind11::module& m) {
  m.def(
      "parallel_backend",
      [] {
        return pybind11::capsule(const_cast<tokenmill_parallel_backend*>(&tokenmill::published_backend),
                                 TOKENMILL_PARALLEL_BACKEND_CAPSULE);
      },
      "The pool as the parallel-loop seam's table (tokenmill/parallel_abi.h), for publish_parallel_backend");
  m.def(
      "set_thread_pool",
      [](const std::string& mode) {
        TORCH_CHECK(mode == "claim" || mode == "openmp", "set_thread_pool: 'claim' or 'openmp', not '", mode, "'");
        tokenmill::pool_mode.store(mode == "claim" ? 1 : 0);
      },
      "The kernels' parallel loop: 'claim' (tokenmill's pool) or 'openmp' (at::parallel_for)");
  m.def("thread_pool", [] { return std::string(tokenmill::claim_pool_enabled() ? "claim" : "openmp"); },
        "Which parallel loop the kernels use");
  m.def(
      "set_pool_threads", [](int64_t threads) { tokenmill::configured_threads.store(static_cast<int>(threads)); },
      "The threads the kernels' regions run on, the calling one included (the platform's count)");
  m.def("pool_threads", &tokenmill::pool_threads, "The threads the kernels' regions run on");
  m.def("park_workers", &tokenmill::park_workers,
        "Spinning workers sleep now (before a region of torch's own; thread_pool.h)");
  m.def(
      "set_thread_binding", [](const std::string& setting) { tokenmill::set_thread_binding(setting); },
      "Where the pool's workers run: 'auto', 'off' or cores like '0,2' (TOKENMILL_CPU_BIND; thread_binding.h)");
  m.def("thread_binding", &tokenmill::thread_binding, "The binding setting in force");
  m.def(
      "thread_pool_stats", [] { return tokenmill::current_pool().stats(); },
      "The claim pool: workers started, whether the contention fallback holds torch at one thread, the "
      "caller's running share of the chunks, how often the fallback engaged, the threads a region runs on, "
      "the binding: the mask it was planned from, each thread's core (the caller's first, not pinned; empty: "
      "none pinned), each worker's core (-1: not pinned) and kernel thread id, the loops of plugin kernels "
      "run through parallel_backend, and the workers asleep (not spinning) for the next region");
  m.def(
      "machine_load",
      [] {
        tokenmill::MachineLoad load;
        {
          pybind11::gil_scoped_release reading;  // this process's Python threads run meanwhile, as they would
          load = tokenmill::machine_load();
        }
        pybind11::dict out;
        out["runnable"] = load.runnable;
        out["ours"] = load.ours;
        out["others"] = load.others();
        return out;
      },
      "Runnable tasks on the machine now, this process's among them, and the others' (machine_load.h)");
  m.def(
      "thread_pool_observe", [](double caller_share) {
        tokenmill::current_pool().observe(caller_share, tokenmill::pool_threads());
      },
      "Feed one region's caller share to the contention gauge, as each region does (for tests)");
}
