// A problem with the user's input or artifacts: main() prints "error: <what>" and exits 2.
#pragma once
#include <stdexcept>
#include <string>

namespace composite {

class RunnerError : public std::runtime_error {
 public:
  explicit RunnerError(const std::string& what) : std::runtime_error(what) {}
};

}  // namespace composite
