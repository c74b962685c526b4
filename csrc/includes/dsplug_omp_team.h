// The OpenMP thread team of torch's own CPU kernels, borrowed for dsplug's kernels.
//
// Why: after each parallel torch op, the OpenMP runtime torch loaded (libgomp on Linux) keeps its
// worker threads spinning for a while before they sleep. Threads dsplug starts itself in that
// window share the cores with those spinners: on 2 cores the CPU Adam step measured anywhere from
// 0.82 to 1.24 of the memory bound depending on what ran just before. Running the kernel on that
// same team (GOMP_parallel, the entry the compiler emits for `#pragma omp parallel`) gives the
// work to the spinning threads instead of competing with them.
//
// The runtime is found among the libraries already loaded (dl_iterate_phdr, then dlopen with
// RTLD_NOLOAD: nothing new is loaded), since torch loads it privately (RTLD_LOCAL). LLVM's libomp
// and Intel's iomp5 export the same GOMP_ entry points. Not found, asked for one thread, or in a
// child forked after this library was loaded, run_on_omp_team returns false and the caller uses
// its own threads: GNU OpenMP does not survive fork (torch's own parallel ops hang in such a child
// unless it sets one thread), and dsplug's own threads do.
#pragma once

#include <dlfcn.h>
#include <pthread.h>
#if defined(__linux__)
#include <link.h>
#endif

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace dsplug {

struct OmpTeam {
    void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;  // GOMP_parallel
    int (*thread_num)() = nullptr;                                            // omp_get_thread_num
    int (*num_threads)() = nullptr;                                           // omp_get_num_threads
    const char* library = "";                                                 // the runtime's path
};

inline std::atomic<bool> omp_team_forked{false};

// registered when the library is loaded, so that every later fork is seen
inline const int omp_team_fork_guard = pthread_atfork(nullptr, nullptr, [] { omp_team_forked.store(true); });

#if defined(__linux__)
inline int find_omp_runtime(struct dl_phdr_info* info, size_t, void* out) {
    const char* name = info->dlpi_name;
    if (!name || !*name) return 0;
    const char* base = std::strrchr(name, '/');
    base = base ? base + 1 : name;
    if (!std::strstr(base, "gomp") && !std::strstr(base, "libomp") && !std::strstr(base, "iomp5")) return 0;
    void* handle = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
    if (!handle) return 0;
    OmpTeam team;
    team.parallel = reinterpret_cast<decltype(team.parallel)>(dlsym(handle, "GOMP_parallel"));
    team.thread_num = reinterpret_cast<int (*)()>(dlsym(handle, "omp_get_thread_num"));
    team.num_threads = reinterpret_cast<int (*)()>(dlsym(handle, "omp_get_num_threads"));
    if (!team.parallel || !team.thread_num || !team.num_threads) return 0;  // keep the handle: harmless
    team.library = name;  // the loader's string, valid while the library stays loaded (it is never closed)
    *static_cast<OmpTeam*>(out) = team;
    return 1;
}
#endif

inline const OmpTeam& omp_team() {
    static const OmpTeam team = [] {
        OmpTeam found;
        const char* off = std::getenv("DSPLUG_OMP_TEAM");  // "0": always use dsplug's own threads
        if (off && std::strcmp(off, "0") == 0) return found;
#if defined(__linux__)
        dl_iterate_phdr(find_omp_runtime, &found);
#endif
        return found;  // elsewhere: no team, dsplug's own threads
    }();
    return team;
}

template <class Fn>
struct OmpTeamCall {
    const Fn* fn;
    const OmpTeam* team;
    static void run(void* data) {
        auto* self = static_cast<OmpTeamCall*>(data);
        (*self->fn)(self->team->thread_num(), self->team->num_threads());
    }
};

// Where parallel kernels run now: the OpenMP runtime's path, or "" for dsplug's own threads.
inline const char* omp_team_library() {
    return omp_team_forked.load() ? "" : omp_team().library;
}

// fn(thread_index, thread_count) on `threads` threads of the OpenMP team; false (nothing run)
// when there is no team to use. fn must not throw (it runs inside the OpenMP region).
template <class Fn>
bool run_on_omp_team(int threads, const Fn& fn) {
    if (threads <= 1 || omp_team_forked.load()) return false;
    const OmpTeam& team = omp_team();
    if (!team.parallel) return false;
    OmpTeamCall<Fn> call{&fn, &team};
    team.parallel(&OmpTeamCall<Fn>::run, &call, unsigned(threads), 0);
    return true;
}

}  // namespace dsplug
