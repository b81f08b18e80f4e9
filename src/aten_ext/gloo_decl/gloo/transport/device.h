// See README.md: only what c10d's ProcessGroupGloo.hpp mentions.
#pragma once

namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo
