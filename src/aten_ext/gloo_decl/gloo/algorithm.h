// See README.md: only what c10d's ProcessGroupGloo.hpp mentions.
#pragma once
#include <gloo/context.h>
