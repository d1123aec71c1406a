#include "stderr_filter.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <iostream>

namespace composite {

namespace {

bool starts_with(const std::string& text, const char* prefix) { return text.rfind(prefix, 0) == 0; }

void write_all(int fd, const std::string& text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n <= 0) return;
    done += static_cast<size_t>(n);
  }
}

// Reads lines from `pipe_fd` until end of file; writes the ones that are not routine to `out_fd`.
// A blank line right after a dropped one belongs to it (the HTP error message ends in its own
// newline before the logger's).
void forward(int pipe_fd, int out_fd) {
  std::string pending;
  bool after_routine = false;
  char buffer[4096];
  ssize_t n;
  while ((n = ::read(pipe_fd, buffer, sizeof buffer)) > 0) {
    pending.append(buffer, static_cast<size_t>(n));
    size_t end;
    while ((end = pending.find('\n')) != std::string::npos) {
      const std::string line = pending.substr(0, end);
      pending.erase(0, end + 1);
      if (is_routine_native_line(line) || (after_routine && line.empty())) {
        after_routine = true;
        continue;
      }
      after_routine = false;
      write_all(out_fd, line + "\n");
    }
  }
  if (!pending.empty() && !is_routine_native_line(pending)) write_all(out_fd, pending);
  ::close(pipe_fd);
}

}  // namespace

bool is_routine_native_line(const std::string& line) {
  static const char* const kRoutine[] = {
      "[INFO] [Qnn ExecuTorch]",
      "[WARNING] [Qnn ExecuTorch]: Qnn API version ",  // "... is used. The version is tested against ..."
      "[ERROR] [Qnn ExecuTorch]:  <E> unexpected GraphHtpSettings option 66",
      " # LIBNATIVE:",
      "# LIBNATIVE:",
      "[cpuinfo_utils.cpp:",
  };
  for (const char* prefix : kRoutine) {
    if (starts_with(line, prefix)) {
      return prefix != kRoutine[1] || line.find(" is tested against ") != std::string::npos;
    }
  }
  return false;
}

RoutineStderrFilter::RoutineStderrFilter() {
  int ends[2];
  std::cerr.flush();
  std::fflush(stderr);
  if (::pipe2(ends, O_CLOEXEC) != 0) return;  // no filter: everything reaches the terminal
  real_stderr_ = ::fcntl(2, F_DUPFD_CLOEXEC, 3);
  if (real_stderr_ < 0 || ::dup2(ends[1], 2) < 0) {
    ::close(ends[0]);
    ::close(ends[1]);
    if (real_stderr_ >= 0) ::close(real_stderr_);
    real_stderr_ = -1;
    return;
  }
  ::close(ends[1]);
  forwarder_ = std::thread(forward, ends[0], real_stderr_);
}

RoutineStderrFilter::~RoutineStderrFilter() {
  if (real_stderr_ < 0) return;
  std::cerr.flush();
  std::fflush(stderr);
  ::dup2(real_stderr_, 2);  // closes the pipe's write end: the forwarder reads end of file
  forwarder_.join();
  ::close(real_stderr_);
}

}  // namespace composite
