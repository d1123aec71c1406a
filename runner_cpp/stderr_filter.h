// Keeps the routine lines that the QNN backend and libraries print straight to file descriptor 2
// (every load and teardown: "[INFO] [Qnn ExecuTorch]: ...") off the terminal. While a
// RoutineStderrFilter lives, fd 2 is a pipe; a thread forwards every other line to the real
// stderr, so a real error is never hidden. --verbose runs without it.
#pragma once
#include <string>
#include <thread>

namespace composite {

// The same list as composite/quiet.py's ROUTINE_NATIVE_LINE, for the lines this runner meets.
bool is_routine_native_line(const std::string& line);

class RoutineStderrFilter {
 public:
  RoutineStderrFilter();
  ~RoutineStderrFilter();  // restores fd 2 and forwards what is left
  RoutineStderrFilter(const RoutineStderrFilter&) = delete;
  RoutineStderrFilter& operator=(const RoutineStderrFilter&) = delete;

 private:
  int real_stderr_ = -1;
  std::thread forwarder_;
};

}  // namespace composite
