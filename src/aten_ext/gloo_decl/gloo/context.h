// See README.md: only what c10d's ProcessGroupGloo.hpp mentions.
#pragma once
#include <chrono>

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
}  // namespace gloo
