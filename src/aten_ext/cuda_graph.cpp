// CUDA graphs for the decoding engines (src/model/decode): libtorch's at::cuda::CUDAGraph behind
// a C interface. A decoding step of a small model is hundreds of tiny kernels whose launch cost
// (not their arithmetic) sets the step time; a captured graph launches them all at once. Also
// the streams and events of src/aten_ext/streams.rs (a target's forwards beside a drafter's
// training on one GPU) and the caching allocator's counters.
//
// Built by build.rs as a shared library against the libtorch headers and the CUDA runtime's
// headers only: it is NOT linked against libtorch_cuda or libcudart (the build machine need not
// have them). Its undefined symbols resolve when the program loads it (src/aten_ext/graph.rs)
// after libtorch_cuda.so was loaded with RTLD_GLOBAL (src/runtime.rs); without CUDA it is never
// loaded.

#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "guard.h"

#include <optional>

using dflash_guard::copy_message;
using dflash_guard::guarded;

// One graph and the side stream it is captured on. Capture needs a stream other than the
// default one; while the side stream is current, every libtorch operation of this thread on
// the device queues there.
struct DflashGraph {
    c10::DeviceIndex device;
    at::cuda::CUDAGraph graph;
    std::optional<c10::cuda::CUDAStreamGuard> side;
    bool captured = false;
};

extern "C" {

// A new, empty graph for CUDA device `device`; null with `*err` set on failure.
DflashGraph *dflash_graph_new(int device, char **err) {
    DflashGraph *g = nullptr;
    *err = guarded([&]() -> char * {
        g = new DflashGraph{static_cast<c10::DeviceIndex>(device)};
        return nullptr;
    });
    return g;
}

// Makes a stream from libtorch's pool the current stream of this thread on the graph's device
// (the caller has synchronised the device, so nothing queued before is pending).
char *dflash_graph_enter_side_stream(DflashGraph *g) {
    return guarded([&]() -> char * {
        if (g->side.has_value()) {
            return copy_message("the side stream is already current");
        }
        g->side.emplace(c10::cuda::getStreamFromPool(false, g->device));
        return nullptr;
    });
}

// Back to the stream that was current before (the caller synchronises the device after).
char *dflash_graph_leave_side_stream(DflashGraph *g) {
    return guarded([&]() -> char * {
        g->side.reset();
        return nullptr;
    });
}

// Starts capturing the work this thread queues on the side stream (which must be current).
// Thread-local capture mode: other threads may use the device meanwhile.
char *dflash_graph_capture_begin(DflashGraph *g) {
    return guarded([&]() -> char * {
        if (!g->side.has_value()) {
            return copy_message("capture needs the side stream to be current");
        }
        if (g->captured) {
            return copy_message("this graph was already captured");
        }
        g->graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
        return nullptr;
    });
}

// Ends the capture and instantiates the graph.
char *dflash_graph_capture_end(DflashGraph *g) {
    return guarded([&]() -> char * {
        g->graph.capture_end();
        g->captured = true;
        return nullptr;
    });
}

// Launches the captured work on the current stream.
char *dflash_graph_replay(DflashGraph *g) {
    return guarded([&]() -> char * {
        if (!g->captured) {
            return copy_message("the graph was not captured");
        }
        g->graph.replay();
        return nullptr;
    });
}

// libtorch's current stream of this thread on CUDA device `device` (the side stream while a
// graph is captured), for kernels launched outside libtorch (src/aten_ext/fused.rs).
char *dflash_current_stream(int device, void **stream) {
    return guarded([&]() -> char * {
        *stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
        return nullptr;
    });
}

// Counters of libtorch's CUDA caching allocator on device `device`, into `out[7]`: retries
// after a failed device allocation (each frees the cache and synchronises the device), syncs
// of all streams, device allocations, device frees, out-of-memory errors, and the peaks of the
// allocated and the reserved bytes since the start.
char *dflash_allocator_stats(int device, int64_t *out) {
    return guarded([&]() -> char * {
        const auto s = c10::cuda::CUDACachingAllocator::getDeviceStats(
            static_cast<c10::DeviceIndex>(device));
        const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
        out[0] = s.num_alloc_retries;
        out[1] = s.num_sync_all_streams;
        out[2] = s.num_device_alloc;
        out[3] = s.num_device_free;
        out[4] = s.num_ooms;
        out[5] = s.allocated_bytes[all].peak;
        out[6] = s.reserved_bytes[all].peak;
        return nullptr;
    });
}

// A stream of libtorch's pool made the current stream of this thread on CUDA device `device`
// until the returned guard is freed (`dflash_stream_guard_free`): the pipeline's target worker
// queues its forwards there, beside a drafter's work on the default stream of the same device.
// Pool streams do not wait for the default stream, nor it for them.
c10::cuda::CUDAStreamGuard *dflash_stream_guard_new(int device, char **err) {
    c10::cuda::CUDAStreamGuard *guard = nullptr;
    *err = guarded([&]() -> char * {
        guard = new c10::cuda::CUDAStreamGuard(
            c10::cuda::getStreamFromPool(false, static_cast<c10::DeviceIndex>(device)));
        return nullptr;
    });
    return guard;
}

// Restores the stream that was current before (on the thread that made the guard).
void dflash_stream_guard_free(c10::cuda::CUDAStreamGuard *guard) {
    try {
        delete guard;
    } catch (...) {
    }
}

// A CUDA event (timing off) recorded now on this thread's current stream of CUDA device
// `device`. (The runtime's own calls: ATen's CUDAEvent header needs CUDA headers the build
// machine lacks.)
void *dflash_stream_event_record(int device, char **err) {
    cudaEvent_t event = nullptr;
    *err = guarded([&]() -> char * {
        const auto index = static_cast<c10::DeviceIndex>(device);
        c10::cuda::CUDAGuard on_device(index);
        cudaError_t rc = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        if (rc == cudaSuccess) {
            rc = cudaEventRecord(event, at::cuda::getCurrentCUDAStream(index).stream());
            if (rc != cudaSuccess) {
                cudaEventDestroy(event);
                event = nullptr;
            }
        }
        if (rc != cudaSuccess) {
            cudaGetLastError();
            return copy_message(cudaGetErrorString(rc));
        }
        return nullptr;
    });
    return event;
}

// Makes this thread's current stream of `device` wait (on the device, the host goes on) for
// the work queued before `event` was recorded.
char *dflash_stream_event_block(void *event, int device) {
    return guarded([&]() -> char * {
        const auto index = static_cast<c10::DeviceIndex>(device);
        c10::cuda::CUDAGuard on_device(index);
        const cudaError_t rc = cudaStreamWaitEvent(
            at::cuda::getCurrentCUDAStream(index).stream(), static_cast<cudaEvent_t>(event), 0);
        if (rc != cudaSuccess) {
            cudaGetLastError();
            return copy_message(cudaGetErrorString(rc));
        }
        return nullptr;
    });
}

void dflash_stream_event_free(void *event) {
    if (event != nullptr) {
        cudaEventDestroy(static_cast<cudaEvent_t>(event));
    }
}

// Tells the caching allocator that `tensor`'s memory is also used on this thread's current
// stream of `device`: once freed, it is handed out again only after the work queued there so
// far has run (`Tensor.record_stream` in PyTorch). Without it, memory made on another stream
// and freed here could be reused there while this stream still reads it.
char *dflash_record_stream(const at::Tensor *tensor, int device) {
    return guarded([&]() -> char * {
        if (tensor == nullptr || !tensor->defined() || !tensor->is_cuda()) {
            return nullptr;
        }
        c10::cuda::CUDACachingAllocator::recordStream(
            tensor->storage().data_ptr(),
            at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)));
        return nullptr;
    });
}

void dflash_graph_free(DflashGraph *g) {
    try {
        delete g;
    } catch (...) {
    }
}

void dflash_graph_free_error(char *err) { dflash_guard::free_message(err); }

}  // extern "C"
