// parallel_units(units, threads, fn): fn(u) for every u in [0, units), on the calling thread and
// threads - 1 detached workers (the sparse-attention and quantizer ops share it).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace dsplug {

// Units are claimed from a shared counter by the calling thread and threads - 1 detached
// workers; the caller waits for the claimed units only, so a worker that starts late finds
// nothing left and exits instead of holding up the call.
//
// Exceptions: a unit that throws (in any thread) records the first std::exception_ptr; after
// that, claimed units are counted as done without running, and the caller rethrows once every
// claimed unit is accounted for (no worker touches `fn` after the caller returns). If starting
// a worker fails (std::thread throws), the workers already started and the caller share the
// units: the work still finishes, with fewer threads.
struct UnitQueue {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::atomic<bool> failed{false};
    int64_t total = 0;
    std::mutex mutex;
    std::condition_variable finished;
    std::exception_ptr error;  // the first exception (guarded by mutex)
};

template <class Fn>
void parallel_units(int64_t units, int64_t threads, const Fn& fn) {  // fn(u) for u in [0, units)
    const int64_t n_threads = std::min<int64_t>(std::max<int64_t>(threads, 1), units);
    if (n_threads <= 1) {
        for (int64_t u = 0; u < units; ++u) fn(u);
        return;
    }
    auto queue = std::make_shared<UnitQueue>();
    queue->total = units;
    const Fn* body = &fn;  // dereferenced only for claimed units, all finished before we return
    auto work = [queue, body] {
        int64_t count = 0;
        for (int64_t u; (u = queue->next.fetch_add(1)) < queue->total; ++count) {
            if (queue->failed.load(std::memory_order_relaxed)) continue;  // counted, not run
            try {
                (*body)(u);
            } catch (...) {
                std::lock_guard<std::mutex> lock(queue->mutex);
                if (!queue->error) queue->error = std::current_exception();
                queue->failed.store(true);
            }
        }
        if (count && queue->done.fetch_add(count) + count == queue->total) {
            std::lock_guard<std::mutex> lock(queue->mutex);
            queue->finished.notify_all();
        }
    };
    for (int64_t t = 1; t < n_threads; ++t) {
        try {
            std::thread(work).detach();
        } catch (...) {  // e.g. std::system_error: no more threads; the caller and started workers finish
            break;
        }
    }
    work();
    std::unique_lock<std::mutex> lock(queue->mutex);
    queue->finished.wait(lock, [&] { return queue->done.load() == queue->total; });
    if (queue->error) std::rethrow_exception(queue->error);
}

}  // namespace dsplug
