// The claiming pool's thread binding (see thread_binding.h for the policy and why).
#include "thread_binding.h"

#include <c10/util/Exception.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>

namespace tokenmill {
namespace {

enum class Mode { automatic, off, listed };

struct Setting {
  std::string text = "auto";
  Mode mode = Mode::automatic;
  std::vector<int> cores;  // Mode::listed: in the order given
};

std::string trimmed(const std::string& text) {
  const auto first = std::find_if_not(text.begin(), text.end(), [](unsigned char c) { return std::isspace(c); });
  const auto last = std::find_if_not(text.rbegin(), text.rend(), [](unsigned char c) { return std::isspace(c); });
  return first < last.base() ? std::string(first, last.base()) : std::string();
}

int core_number(const std::string& text, const std::string& setting) {
  const std::string number = trimmed(text);
  TORCH_CHECK(!number.empty() && std::all_of(number.begin(), number.end(), [](unsigned char c) { return std::isdigit(c); }),
              "TOKENMILL_CPU_BIND: 'auto', 'off' or cores like '0,2' or '0-3,8', not '", setting, "'");
  return std::stoi(number);
}

// "auto", "off" ("nobind", vLLM's word, too) or a list of cores and ranges of cores.
Setting parse(const std::string& given) {
  Setting setting;
  setting.text = trimmed(given);
  std::string lower = setting.text;
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower.empty() || lower == "auto") {
    setting.text = "auto";
    return setting;
  }
  if (lower == "off" || lower == "nobind") {
    setting.text = "off";
    setting.mode = Mode::off;
    return setting;
  }
  setting.mode = Mode::listed;
  size_t start = 0;
  while (start <= setting.text.size()) {
    const size_t comma = std::min(setting.text.find(',', start), setting.text.size());
    const std::string item = setting.text.substr(start, comma - start);
    const size_t dash = item.find('-');
    const int first = core_number(item.substr(0, dash), setting.text);
    const int last = dash == std::string::npos ? first : core_number(item.substr(dash + 1), setting.text);
    TORCH_CHECK(first <= last && last < CPU_SETSIZE, "TOKENMILL_CPU_BIND: no cores in '", item, "' of '",
                setting.text, "'");
    for (int core = first; core <= last; ++core) setting.cores.push_back(core);
    start = comma + 1;
  }
  return setting;
}

std::mutex setting_lock;
bool setting_read = false;
Setting current_setting;
std::atomic<uint64_t> epoch{0};

Setting setting() {
  std::lock_guard<std::mutex> lock(setting_lock);
  if (!setting_read) {
    const char* configured = std::getenv("TOKENMILL_CPU_BIND");
    current_setting = parse(configured != nullptr ? configured : "auto");  // a bad value raises on every use
    setting_read = true;
  }
  return current_setting;
}

std::vector<int> affinity_mask() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cores;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cores;  // more CPUs than a cpu_set_t holds
  for (int core = 0; core < CPU_SETSIZE; ++core) {
    if (CPU_ISSET(core, &set)) cores.push_back(core);
  }
  return cores;
}

}  // namespace

std::string thread_binding() { return setting().text; }

void set_thread_binding(const std::string& given) {
  Setting parsed = parse(given);
  std::lock_guard<std::mutex> lock(setting_lock);
  current_setting = std::move(parsed);
  setting_read = true;
  epoch.fetch_add(1, std::memory_order_acq_rel);
}

uint64_t thread_binding_epoch() { return epoch.load(std::memory_order_acquire); }

BindPlan plan_binding(int threads) {
  const Setting wanted = setting();
  BindPlan plan;
  plan.threads = std::max(1, threads);
  plan.mask = affinity_mask();
  if (wanted.mode == Mode::off || plan.mask.empty()) return plan;
  std::vector<int> candidates;
  if (wanted.mode == Mode::automatic) {
    candidates = plan.mask;
  } else {
    for (int core : wanted.cores) {
      const bool allowed = std::binary_search(plan.mask.begin(), plan.mask.end(), core);
      if (allowed && std::find(candidates.begin(), candidates.end(), core) == candidates.end()) {
        candidates.push_back(core);
      }
    }
  }
  if (candidates.empty()) {  // no listed core is ours: one thread, wherever the mask lets it run
    plan.threads = 1;
    return plan;
  }
  plan.threads = std::min<int>(plan.threads, static_cast<int>(candidates.size()));
  if (wanted.mode == Mode::automatic && plan.threads < static_cast<int>(candidates.size())) return plan;
  plan.cores.assign(candidates.begin(), candidates.begin() + plan.threads);
  return plan;
}

bool pin_thread(pthread_t thread, int core, const std::vector<int>& mask) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (core >= 0) {
    CPU_SET(core, &set);
  } else {
    if (mask.empty()) return false;
    for (int allowed : mask) CPU_SET(allowed, &set);
  }
  return pthread_setaffinity_np(thread, sizeof(set), &set) == 0;
}

}  // namespace tokenmill
