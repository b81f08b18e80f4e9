// See README.md: only what c10d's ProcessGroupGloo.hpp mentions (nothing from this header).
#pragma once
