// Error handling of the C shims (ops.cpp, cuda_graph.cpp): every C++ exception becomes a
// malloc'd message that the Rust side frees, so that nothing unwinds into Rust.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
#include <cstring>
#include <exception>

namespace dflash_guard {

// What an error is reported as when its message cannot be copied (never freed).
inline char out_of_memory[] = "out of memory while copying an error message";

inline char *copy_message(const char *msg) {
    if (msg == nullptr) {
        msg = "unknown error";
    }
    size_t len = std::strlen(msg);
    char *out = static_cast<char *>(std::malloc(len + 1));
    if (out == nullptr) {
        return out_of_memory;
    }
    std::memcpy(out, msg, len + 1);
    return out;
}

// Runs `body` (which returns null or an error message) with every C++ exception turned into
// its message.
template <typename Body>
char *guarded(Body &&body) {
    try {
        return body();
    } catch (const c10::Error &e) {
        return copy_message(e.what_without_backtrace());
    } catch (const std::exception &e) {
        return copy_message(e.what());
    } catch (...) {
        return copy_message("unknown C++ exception");
    }
}

// Frees a message from `copy_message` (never the static one).
inline void free_message(char *err) {
    if (err != out_of_memory) {
        std::free(err);
    }
}

}  // namespace dflash_guard
