// The machine's runnable tasks against this process's own (see machine_load.h for why).
#include "machine_load.h"

#include <dirent.h>
#include <fcntl.h>
#include <unistd.h>

#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tokenmill {
namespace {

// The file's first bytes, NUL-terminated; false where it cannot be read.
bool read_small_file(const char* path, char* buffer, size_t size) {
  const int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const ssize_t got = read(fd, buffer, size - 1);
  close(fd);
  if (got <= 0) return false;
  buffer[got] = '\0';
  return true;
}

// "0.52 0.58 0.59 3/467 12345": the 3, runnable tasks now (the reading one among them).
int machine_runnable() {
  char text[128];
  if (!read_small_file("/proc/loadavg", text, sizeof(text))) return -1;
  const char* field = text;
  for (int spaces = 0; spaces < 3; ++spaces) {
    field = std::strchr(field, ' ');
    if (field == nullptr) return -1;
    ++field;
  }
  return std::atoi(field);
}

// Threads of this process in state R ("tid (name) R ...": the name may hold spaces and
// parentheses, so the state is read after the last ')').
int our_runnable() {
  DIR* tasks = opendir("/proc/self/task");
  if (tasks == nullptr) return 0;
  int running = 0;
  char path[64], text[512];
  while (const dirent* entry = readdir(tasks)) {
    if (entry->d_name[0] < '0' || entry->d_name[0] > '9') continue;
    std::snprintf(path, sizeof(path), "/proc/self/task/%s/stat", entry->d_name);
    if (!read_small_file(path, text, sizeof(text))) continue;  // the thread just ended
    const char* name_end = std::strrchr(text, ')');
    if (name_end != nullptr && name_end[1] == ' ' && name_end[2] == 'R') ++running;
  }
  closedir(tasks);
  return running;
}

}  // namespace

MachineLoad machine_load() {
  MachineLoad load;
  load.runnable = machine_runnable();
  load.ours = our_runnable();
  return load;
}

int others_runnable(int samples) {
  int least = INT_MAX;
  for (int i = 0; i < samples; ++i) {
    const int others = machine_load().others();
    if (others < 0) return -1;
    least = std::min(least, others);
  }
  return least == INT_MAX ? -1 : least;
}

}  // namespace tokenmill
