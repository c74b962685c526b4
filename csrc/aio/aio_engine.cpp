#include "aio_engine.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if DSPLUG_HAVE_LIBAIO
#include <libaio.h>
#endif

namespace dsplug {
namespace aio {

namespace {

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

std::string errno_text(int code) { return std::string(std::strerror(code)); }

// Sizes the file for a write that extends it, before any block is queued. Direct writes past
// the end of a file make the file system (ext4, xfs) update its size under a lock, which
// serializes them and makes io_submit block; writes inside the file's allocated size do not.
void extend_for_write(IoRequest& r) {
    struct stat st;
    const int64_t end = r.file_offset + r.nbytes;
    if (r.nbytes == 0 || ::fstat(r.buffered_fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size >= end) return;
#if defined(__linux__)
    if (::fallocate(r.buffered_fd, 0, st.st_size, end - st.st_size) == 0) return;
#endif
    // No fallocate (or not supported here): a sparse extension still avoids size updates per block.
    if (::ftruncate(r.buffered_fd, end) != 0) { /* not fatal: the writes extend the file themselves */ }
}

}  // namespace

// ------------------------------------------------------------------------------ IoRequest

void IoRequest::fail(int code, const std::string& message) {
    std::lock_guard<std::mutex> lock(error_mutex);
    if (!failed.exchange(true)) error = {code, message};
}

std::string IoRequest::describe(int64_t offset, int64_t length) const {
    return std::string(is_read ? "read of " : "write of ") + std::to_string(length) + " bytes at file offset " +
           std::to_string(file_offset + offset) + (is_read ? " from '" : " to '") + filename + "'";
}

IoRequest::~IoRequest() {
    if (direct_fd >= 0) ::close(direct_fd);
    if (buffered_fd >= 0) ::close(buffered_fd);
}

// ------------------------------------------------------------------------------ AioEngine

AioEngine::AioEngine(const AioConfig& config, const std::string& backend) : config_(config) {
    if (config_.block_size <= 0) throw std::invalid_argument("block_size must be > 0, got " + std::to_string(config_.block_size));
    if (config_.queue_depth <= 0) throw std::invalid_argument("queue_depth must be > 0, got " + std::to_string(config_.queue_depth));
    if (config_.intra_op_parallelism <= 0)
        throw std::invalid_argument("intra_op_parallelism must be > 0, got " + std::to_string(config_.intra_op_parallelism));
    if (backend != "auto" && backend != "libaio" && backend != "threads")
        throw std::invalid_argument("unknown aio backend '" + backend + "' (valid: auto, libaio, threads)");
    if (backend == "libaio" && !libaio_compiled())
        throw std::runtime_error("aio backend 'libaio' requested but this build has no libaio (libaio.h was not "
                                 "found when the op was built; install libaio-dev and rebuild)");
#if DSPLUG_HAVE_LIBAIO
    if (backend != "threads") {
        use_libaio_ = true;
        for (int i = 0; i < config_.intra_op_parallelism; ++i) {
            io_context_t ctx = 0;
            int rc = io_setup(config_.queue_depth, &ctx);
            if (rc < 0) {
                for (void* c : contexts_) io_destroy(static_cast<io_context_t>(c));
                contexts_.clear();
                use_libaio_ = false;
                if (backend == "libaio")
                    throw std::runtime_error("io_setup(queue_depth=" + std::to_string(config_.queue_depth) +
                                             ") failed: " + errno_text(-rc) + " (see /proc/sys/fs/aio-max-nr)");
                break;
            }
            contexts_.push_back(static_cast<void*>(ctx));
        }
    }
#endif
    for (int i = 0; i < config_.intra_op_parallelism; ++i) workers_.emplace_back(&AioEngine::worker_loop, this, i);
}

AioEngine::~AioEngine() {
    wait();  // buffers of queued requests belong to the caller: never leave I/O running on them
    {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        stopping_ = true;
    }
    queue_cv_.notify_all();
    for (auto& w : workers_) w.join();
#if DSPLUG_HAVE_LIBAIO
    for (void* c : contexts_) io_destroy(static_cast<io_context_t>(c));
#endif
}

std::shared_ptr<IoRequest> AioEngine::open_request(bool is_read, uintptr_t buffer, int64_t nbytes,
                                                   const std::string& filename, int64_t file_offset, IoError* error) {
    auto r = std::make_shared<IoRequest>();
    r->is_read = is_read;
    r->buffer = reinterpret_cast<char*>(buffer);
    r->nbytes = nbytes;
    r->file_offset = file_offset;
    r->filename = filename;
    const int flags = (is_read ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_CLOEXEC;
    r->buffered_fd = ::open(filename.c_str(), flags, 0644);
    if (r->buffered_fd < 0) {
        int code = errno;
        *error = {code, std::string("cannot open '") + filename + "' for " + (is_read ? "reading" : "writing") +
                            ": " + errno_text(code)};
        return nullptr;
    }
#ifdef O_DIRECT
    const bool aligned = buffer % kDirectAlignment == 0 && file_offset % kDirectAlignment == 0;
    if (aligned && nbytes >= kDirectAlignment) {
        r->direct_fd = ::open(filename.c_str(), flags | O_DIRECT, 0644);
        // A file system that refuses O_DIRECT (tmpfs: EINVAL) is served by the buffered path.
        if (r->direct_fd >= 0) r->direct_bytes = nbytes / kDirectAlignment * kDirectAlignment;
    }
#endif
    if (!is_read) extend_for_write(*r);
    *error = {0, ""};
    return r;
}

IoError AioEngine::submit(bool is_read, uintptr_t buffer, int64_t nbytes, const std::string& filename,
                          int64_t file_offset) {
    IoError error;
    auto r = open_request(is_read, buffer, nbytes, filename, file_offset, &error);
    if (!r) return error;
    // Slice boundaries are multiples of the O_DIRECT alignment, so every slice's direct part is aligned.
    const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(config_.intra_op_parallelism,
                                                                  (nbytes + kDirectAlignment - 1) / kDirectAlignment));
    const int64_t slice_bytes = std::max<int64_t>(kDirectAlignment, round_up((nbytes + parts - 1) / parts, kDirectAlignment));
    std::vector<Slice> slices;
    for (int64_t begin = 0; begin < nbytes || slices.empty(); begin += slice_bytes)
        slices.push_back({r, begin, std::min(nbytes, begin + slice_bytes)});
    r->pending_slices = int(slices.size());
    {
        std::lock_guard<std::mutex> lock(done_mutex_);
        ++submitted_;
    }
    {
        std::lock_guard<std::mutex> lock(queue_mutex_);
        for (auto& s : slices) queue_.push_back(std::move(s));
    }
    queue_cv_.notify_all();
    return {0, ""};
}

std::pair<int64_t, std::vector<IoError>> AioEngine::wait() {
    std::unique_lock<std::mutex> lock(done_mutex_);
    done_cv_.wait(lock, [this] { return completed_ == submitted_; });
    int64_t count = completed_ - reported_;
    reported_ = completed_;
    std::vector<IoError> errors;
    errors.swap(errors_);
    return {count, errors};
}

IoError AioEngine::run_blocking(bool is_read, uintptr_t buffer, int64_t nbytes, const std::string& filename,
                                int64_t file_offset) {
    IoError error;
    auto r = open_request(is_read, buffer, nbytes, filename, file_offset, &error);
    if (!r) return error;
    const int64_t direct_block = round_up(config_.block_size, kDirectAlignment);
    if (r->direct_bytes > 0) blocking_range(*r, r->direct_fd, 0, r->direct_bytes, direct_block);
    if (!r->failed && r->direct_bytes < nbytes)
        blocking_range(*r, r->buffered_fd, r->direct_bytes, nbytes, config_.block_size);
    std::lock_guard<std::mutex> lock(r->error_mutex);
    return r->error;
}

void AioEngine::worker_loop(int index) {
    for (;;) {
        Slice slice;
        {
            std::unique_lock<std::mutex> lock(queue_mutex_);
            queue_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
            if (queue_.empty()) return;  // stopping
            slice = std::move(queue_.front());
            queue_.pop_front();
        }
        process(slice, index);
        finish_slice(slice.request);
    }
}

void AioEngine::process(const Slice& s, int worker) {
    IoRequest& r = *s.request;
    if (r.failed) return;
    const int64_t direct_end = std::min(s.end, r.direct_bytes);
    if (s.begin < direct_end) {
        const int64_t block = round_up(config_.block_size, kDirectAlignment);
        bool ok = use_libaio_ ? libaio_range(r, worker, s.begin, direct_end, block)
                              : blocking_range(r, r.direct_fd, s.begin, direct_end, block);
        if (!ok) return;
    }
    const int64_t buffered_begin = std::max(s.begin, r.direct_bytes);
    if (buffered_begin < s.end) blocking_range(r, r.buffered_fd, buffered_begin, s.end, config_.block_size);
}

void AioEngine::finish_slice(const std::shared_ptr<IoRequest>& request) {
    if (--request->pending_slices > 0) return;
    std::lock_guard<std::mutex> lock(done_mutex_);
    if (request->failed) {
        std::lock_guard<std::mutex> elock(request->error_mutex);
        errors_.push_back(request->error);
    }
    ++completed_;
    done_cv_.notify_all();
}

// Blocking pread/pwrite of [begin, end) in chunks of `block` bytes. A short transfer on the
// O_DIRECT descriptor (end of file mid-block) continues on the buffered descriptor, whose reads
// may end anywhere.
bool AioEngine::blocking_range(IoRequest& r, int fd, int64_t begin, int64_t end, int64_t block) {
    for (int64_t off = begin; off < end;) {
        const size_t len = size_t(std::min(block, end - off));
        ssize_t n = r.is_read ? ::pread(fd, r.buffer + off, len, r.file_offset + off)
                              : ::pwrite(fd, r.buffer + off, len, r.file_offset + off);
        if (n < 0) {
            if (errno == EINTR) continue;
            int code = errno;
            r.fail(code, r.describe(off, int64_t(len)) + " failed: " + errno_text(code));
            return false;
        }
        if (n == 0) {
            r.fail(r.is_read ? kEndOfFile : EIO,
                   r.describe(off, end - off) + (r.is_read ? " hit the end of the file" : " wrote nothing"));
            return false;
        }
        off += n;
        if (size_t(n) < len) fd = r.buffered_fd;
    }
    return true;
}

#if DSPLUG_HAVE_LIBAIO
bool AioEngine::libaio_range(IoRequest& r, int worker, int64_t begin, int64_t end, int64_t block) {
    io_context_t ctx = static_cast<io_context_t>(contexts_[size_t(worker)]);
    const int depth = config_.queue_depth;
    std::vector<struct iocb> cbs(static_cast<size_t>(depth));
    std::vector<struct iocb*> free_cbs, batch;
    std::vector<struct io_event> events(static_cast<size_t>(depth));
    for (auto& cb : cbs) free_cbs.push_back(&cb);
    int64_t next = begin;
    int inflight = 0;
    bool ok = true;
    while ((ok && next < end) || inflight > 0) {
        // Queue blocks until the depth is reached (never after an error: only drain then).
        batch.clear();
        while (ok && next < end && !free_cbs.empty()) {
            struct iocb* cb = free_cbs.back();
            free_cbs.pop_back();
            const int64_t len = std::min(block, end - next);
            if (r.is_read)
                io_prep_pread(cb, r.direct_fd, r.buffer + next, size_t(len), r.file_offset + next);
            else
                io_prep_pwrite(cb, r.direct_fd, r.buffer + next, size_t(len), r.file_offset + next);
            cb->data = reinterpret_cast<void*>(uintptr_t(len));
            batch.push_back(cb);
            next += len;
        }
        size_t done = 0;
        while (done < batch.size()) {
            const long want = config_.single_submit ? 1 : long(batch.size() - done);
            int rc = io_submit(ctx, want, batch.data() + done);
            if (rc == -EAGAIN || rc == -EINTR) {
                if (inflight > 0) break;  // reap first, then resubmit what is left
                std::this_thread::yield();
                continue;
            }
            if (rc < 0) {
                r.fail(-rc, r.describe(int64_t(batch[done]->u.c.offset) - r.file_offset, int64_t(batch[done]->u.c.nbytes)) +
                                " could not be submitted: " + errno_text(-rc));
                ok = false;
                break;
            }
            done += size_t(rc);
            inflight += rc;
        }
        for (size_t i = done; i < batch.size(); ++i) {  // not submitted: give back, rewind
            next = std::min<int64_t>(next, int64_t(batch[i]->u.c.offset) - r.file_offset);
            free_cbs.push_back(batch[i]);
        }
        if (inflight == 0) continue;
        // overlap_events: refill as soon as one block completes; otherwise drain the whole batch.
        const long min_events = config_.overlap_events ? 1 : inflight;
        int got = io_getevents(ctx, min_events, depth, events.data(), nullptr);
        if (got == -EINTR) continue;
        if (got < 0) {
            // Only EFAULT/EINVAL remain, i.e. a corrupted context. Blocks still in flight write into
            // the caller's buffer, so returning would be unsafe: stop the process loudly.
            std::fprintf(stderr, "dsplug aio: io_getevents failed during %s: %s\n",
                         r.describe(begin, end - begin).c_str(), errno_text(-got).c_str());
            std::abort();
        }
        for (int i = 0; i < got; ++i) {
            struct iocb* cb = events[size_t(i)].obj;
            const long res = long(events[size_t(i)].res);
            const int64_t len = int64_t(uintptr_t(cb->data));
            const int64_t off = int64_t(cb->u.c.offset) - r.file_offset;
            --inflight;
            free_cbs.push_back(cb);
            if (res < 0) {
                r.fail(int(-res), r.describe(off, len) + " failed: " + errno_text(int(-res)));
                ok = false;
            } else if (res < len && ok) {
                // Short transfer (end of file for reads): finish the block through the buffered path.
                ok = blocking_range(r, r.buffered_fd, off + res, off + len, len);
            }
        }
    }
    return ok;
}
#else
bool AioEngine::libaio_range(IoRequest& r, int, int64_t begin, int64_t end, int64_t block) {
    return blocking_range(r, r.direct_fd, begin, end, block);
}
#endif

bool libaio_compiled() {
#if DSPLUG_HAVE_LIBAIO
    return true;
#else
    return false;
#endif
}

bool lock_memory(uintptr_t address, int64_t nbytes) { return ::mlock(reinterpret_cast<void*>(address), size_t(nbytes)) == 0; }

bool unlock_memory(uintptr_t address, int64_t nbytes) {
    return ::munlock(reinterpret_cast<void*>(address), size_t(nbytes)) == 0;
}

}  // namespace aio
}  // namespace dsplug
