// libtorch's profiler (Kineto, what torch.profiler runs on), which tch 0.24 does not bind:
// started on the calling thread, stopped with its trace written as Chrome trace JSON (the file
// torch.profiler's `export_chrome_trace` writes; Perfetto and chrome://tracing open it). With
// CUDA it records the kernels on the device too.
// Built by build.rs with ops.cpp; the symbols resolve from libtorch_cpu.

#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include "guard.h"

#include <set>
#include <string>

using dflash_guard::copy_message;
using dflash_guard::guarded;

extern "C" {

// Starts the profiler on this thread: the operators it runs (with their input shapes) and,
// when `cuda` is non-zero, the CUDA kernels and copies. Null on success, else a malloc'd
// message (freed with `dflash_free_error`).
char *dflash_profiler_start(int cuda) {
    return guarded([&]() -> char * {
        using torch::profiler::impl::ActivityType;
        using torch::profiler::impl::ProfilerConfig;
        using torch::profiler::impl::ProfilerState;
        ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/true);
        std::set<ActivityType> activities{ActivityType::CPU};
        if (cuda != 0) {
            activities.insert(ActivityType::CUDA);
        }
        torch::autograd::profiler::prepareProfiler(config, activities);
        torch::autograd::profiler::enableProfiler(config, activities);
        return nullptr;
    });
}

// Stops the profiler started on this thread and writes its trace to `path` (UTF-8), or drops
// it when `path` is null. Null on success, else a malloc'd message.
char *dflash_profiler_stop(const char *path) {
    return guarded([&]() -> char * {
        auto result = torch::autograd::profiler::disableProfiler();
        if (!result) {
            return copy_message("the profiler was not running");
        }
        if (path != nullptr) {
            result->save(std::string(path));
        }
        return nullptr;
    });
}

// Opens a named range (what torch.profiler.record_function opens: a "user_annotation" in the
// trace, enclosing the operators and launches made inside it) on this thread and returns it;
// `dflash_profiler_range_end` closes it. Near free while no profiler runs. Null on failure.
void *dflash_profiler_range_begin(const char *name) {
    try {
        auto *range = new at::RecordFunction(at::RecordScope::USER_SCOPE);
        if (range->isActive()) {
            range->before(name);
        }
        return range;
    } catch (...) {
        return nullptr;
    }
}

void dflash_profiler_range_end(void *range) {
    try {
        delete static_cast<at::RecordFunction *>(range);
    } catch (...) {
    }
}

} // extern "C"
