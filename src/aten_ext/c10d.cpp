// torch.distributed's c10d behind a C interface (tch binds none of it): the rendezvous store
// (`c10d::TCPStore` at MASTER_ADDR:MASTER_PORT, hosted by rank 0) and the Gloo process group
// (`c10d::ProcessGroupGloo`, compiled into libtorch_cpu) for collectives on CPU tensors.
// Built by build.rs like ops.cpp, with USE_C10D_GLOO and the Gloo declarations in gloo_decl/
// (see its README: the wheels ship no Gloo headers). Tensors are tch's `at::Tensor *`; every
// function returns null or a malloc'd message (guard.h), so no exception reaches Rust.

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "guard.h"

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

using dflash_guard::copy_message;
using dflash_guard::guarded;

namespace {

struct Group {
    c10::intrusive_ptr<c10d::Store> store;
    c10::intrusive_ptr<c10d::Backend> gloo;
    std::chrono::milliseconds timeout;
};

bool is_loopback(const std::string &host) {
    return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// The network device Gloo listens on: GLOO_SOCKET_IFNAME's interface (as torch.distributed
// reads it), the loopback when every rank is on this host, else the address this host's name
// resolves to.
std::shared_ptr<::gloo::transport::Device> gloo_device(const std::string &master) {
    if (const char *ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
        std::string first(ifname);
        first = first.substr(0, first.find(','));
        return c10d::ProcessGroupGloo::createDeviceForInterface(first);
    }
    if (is_loopback(master)) {
        return c10d::ProcessGroupGloo::createDeviceForHostname(master);
    }
    return c10d::ProcessGroupGloo::createDefaultDevice();
}

c10::intrusive_ptr<c10d::Backend> backend_for(Group *g, const at::Tensor &t) {
    if (t.device().is_cpu()) {
        return g->gloo;
    }
    TORCH_CHECK(false, "this build's c10d has no backend for ", t.device(),
                " tensors (Gloo takes CPU tensors)");
}

}  // namespace

extern "C" {

// Joins the group: rank 0 hosts the store at `host`:`port` and waits up to `timeout_ms` for
// the other `world - 1` ranks; the others connect to it. The same timeout bounds every
// collective and store read after. On success `*out` is the group, freed with
// `dflash_c10d_free`.
char *dflash_c10d_connect(const char *host, int port, int rank, int world, int64_t timeout_ms,
                          void **out) {
    return guarded([&]() -> char * {
        if (host == nullptr || out == nullptr) {
            return copy_message("a null argument was passed");
        }
        auto timeout = std::chrono::milliseconds(timeout_ms);
        c10d::TCPStoreOptions opts;
        opts.port = static_cast<std::uint16_t>(port);
        opts.isServer = rank == 0;
        opts.numWorkers = world;
        opts.waitWorkers = true;
        opts.timeout = timeout;
        auto store = c10::make_intrusive<c10d::TCPStore>(std::string(host), opts);
        auto gopts = c10d::ProcessGroupGloo::Options::create(timeout);
        gopts->devices.push_back(gloo_device(host));
        auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world, gopts);
        *out = new Group{store, gloo, timeout};
        return nullptr;
    });
}

void dflash_c10d_free(void *group) { delete static_cast<Group *>(group); }

// Sums `tensor` over every rank, in place.
char *dflash_c10d_allreduce_sum(void *group, const at::Tensor *tensor) {
    return guarded([&]() -> char * {
        auto *g = static_cast<Group *>(group);
        std::vector<at::Tensor> ts{*tensor};
        backend_for(g, *tensor)->allreduce(ts)->wait(g->timeout);
        return nullptr;
    });
}

// Rank r's `input` is cut into `world` equal rows; row k goes to rank k, which gets every
// rank's row in rank order in `output` (the same size as `input`).
char *dflash_c10d_alltoall(void *group, const at::Tensor *output, const at::Tensor *input) {
    return guarded([&]() -> char * {
        auto *g = static_cast<Group *>(group);
        at::Tensor out = *output;
        at::Tensor in = *input;
        std::vector<int64_t> equal_splits;
        backend_for(g, in)->alltoall_base(out, in, equal_splits, equal_splits)->wait(g->timeout);
        return nullptr;
    });
}

// Every rank's `input` side by side in `output` (`world` times its size), in rank order.
char *dflash_c10d_allgather(void *group, const at::Tensor *output, const at::Tensor *input) {
    return guarded([&]() -> char * {
        auto *g = static_cast<Group *>(group);
        at::Tensor out = *output;
        at::Tensor in = *input;
        backend_for(g, in)->_allgather_base(out, in)->wait(g->timeout);
        return nullptr;
    });
}

// Copies rank `root`'s `tensor` into every rank's, in place.
char *dflash_c10d_broadcast(void *group, const at::Tensor *tensor, int root) {
    return guarded([&]() -> char * {
        auto *g = static_cast<Group *>(group);
        std::vector<at::Tensor> ts{*tensor};
        c10d::BroadcastOptions opts;
        opts.rootRank = root;
        backend_for(g, *tensor)->broadcast(ts, opts)->wait(g->timeout);
        return nullptr;
    });
}

// Returns once every rank has called it.
char *dflash_c10d_barrier(void *group) {
    return guarded([&]() -> char * {
        auto *g = static_cast<Group *>(group);
        g->gloo->barrier()->wait(g->timeout);
        return nullptr;
    });
}

// Sets `key` in the store to `len` bytes.
char *dflash_c10d_store_set(void *group, const char *key, const std::uint8_t *data, size_t len) {
    return guarded([&]() -> char * {
        auto *g = static_cast<Group *>(group);
        std::vector<std::uint8_t> value(data, data + len);
        g->store->set(std::string(key), value);
        return nullptr;
    });
}

// Whether `key` is set (no waiting): `*set` is 1 or 0.
char *dflash_c10d_store_check(void *group, const char *key, int *set) {
    return guarded([&]() -> char * {
        auto *g = static_cast<Group *>(group);
        *set = g->store->check({std::string(key)}) ? 1 : 0;
        return nullptr;
    });
}

// The value of `key`, waiting for it up to `timeout_ms`: `*out` (malloc'd, freed with
// `dflash_c10d_free_bytes`) holds `*len` bytes.
char *dflash_c10d_store_get(void *group, const char *key, int64_t timeout_ms, std::uint8_t **out,
                            size_t *len) {
    return guarded([&]() -> char * {
        auto *g = static_cast<Group *>(group);
        std::string k(key);
        g->store->wait({k}, std::chrono::milliseconds(timeout_ms));
        auto value = g->store->get(k);
        *len = value.size();
        *out = static_cast<std::uint8_t *>(std::malloc(value.empty() ? 1 : value.size()));
        if (*out == nullptr) {
            return copy_message("out of memory reading the store");
        }
        if (!value.empty()) {
            std::memcpy(*out, value.data(), value.size());
        }
        return nullptr;
    });
}

void dflash_c10d_free_bytes(std::uint8_t *bytes) { std::free(bytes); }

}  // extern "C"
