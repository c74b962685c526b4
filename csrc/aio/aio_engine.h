// Asynchronous file I/O between memory buffers and files, behind DeepNVMe's aio_handle API.
//
// A request (one buffer <-> one file region) is split into `intra_op_parallelism` contiguous
// slices that worker threads process concurrently. The 4 KiB-aligned prefix of a request whose
// buffer address and file offset are aligned goes through O_DIRECT (bypassing the page cache);
// the unaligned tail, unaligned buffers and file systems that refuse O_DIRECT use ordinary
// buffered pread/pwrite. With the libaio backend each worker keeps up to `queue_depth` requests
// of `block_size` bytes in flight in its own kernel AIO context; the portable "threads" backend
// issues blocking pread/pwrite calls of `block_size` bytes instead.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace dsplug {
namespace aio {

constexpr int64_t kDirectAlignment = 4096;  // buffer address, file offset and length for O_DIRECT
constexpr int kEndOfFile = -1;              // error code of a read that hit end of file (not an errno)

struct AioConfig {
    int64_t block_size = 1048576;
    int queue_depth = 128;
    bool single_submit = false;
    bool overlap_events = false;
    int intra_op_parallelism = 1;
};

// (code, message): code is an errno, or kEndOfFile.
using IoError = std::pair<int, std::string>;

struct IoRequest {
    bool is_read = true;
    char* buffer = nullptr;
    int64_t nbytes = 0;
    int64_t file_offset = 0;
    std::string filename;
    int buffered_fd = -1;
    int direct_fd = -1;        // -1 when the request cannot or may not use O_DIRECT
    int64_t direct_bytes = 0;  // bytes [0, direct_bytes) of the request go through direct_fd
    std::atomic<int> pending_slices{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    IoError error{0, ""};

    void fail(int code, const std::string& message);
    std::string describe(int64_t offset, int64_t length) const;  // "read of N bytes at ... of 'file'"
    ~IoRequest();
};

struct Slice {
    std::shared_ptr<IoRequest> request;
    int64_t begin = 0, end = 0;  // byte range of the request's buffer
};

class AioEngine {
   public:
    // backend: "auto" (libaio when compiled in and usable, else threads), "libaio" or "threads".
    AioEngine(const AioConfig& config, const std::string& backend);
    ~AioEngine();
    AioEngine(const AioEngine&) = delete;
    AioEngine& operator=(const AioEngine&) = delete;

    // Opens the file and queues the request. Returns {0, ""} or the error of opening the file.
    IoError submit(bool is_read, uintptr_t buffer, int64_t nbytes, const std::string& filename, int64_t file_offset);
    // Blocks until every queued request is done; returns how many completed since the previous
    // wait() and the errors of those that failed.
    std::pair<int64_t, std::vector<IoError>> wait();
    // Performs one request on the calling thread, without the queue (blocking read()/write()).
    IoError run_blocking(bool is_read, uintptr_t buffer, int64_t nbytes, const std::string& filename,
                         int64_t file_offset);

    const AioConfig& config() const { return config_; }
    std::string backend() const { return use_libaio_ ? "libaio" : "threads"; }

   private:
    std::shared_ptr<IoRequest> open_request(bool is_read, uintptr_t buffer, int64_t nbytes,
                                            const std::string& filename, int64_t file_offset, IoError* error);
    void worker_loop(int index);
    void process(const Slice& slice, int worker);
    void finish_slice(const std::shared_ptr<IoRequest>& request);
    bool blocking_range(IoRequest& r, int fd, int64_t begin, int64_t end, int64_t block);
    bool libaio_range(IoRequest& r, int worker, int64_t begin, int64_t end, int64_t block);

    AioConfig config_;
    bool use_libaio_ = false;
    std::vector<void*> contexts_;  // one io_context_t per worker (libaio backend)
    std::vector<std::thread> workers_;

    std::mutex queue_mutex_;
    std::condition_variable queue_cv_;
    std::deque<Slice> queue_;
    bool stopping_ = false;

    std::mutex done_mutex_;
    std::condition_variable done_cv_;
    int64_t submitted_ = 0, completed_ = 0, reported_ = 0;
    std::vector<IoError> errors_;
};

bool libaio_compiled();
bool lock_memory(uintptr_t address, int64_t nbytes);
bool unlock_memory(uintptr_t address, int64_t nbytes);

}  // namespace aio
}  // namespace dsplug
