// Python bindings of the async_io op. The Python class dsplug.ops.native.aio.AioHandle checks
// tensors and file names and hands raw buffer addresses to this engine; every call that may block
// (open, submit, wait, blocking I/O) releases the GIL.
#include <pybind11/pybind11.h>

#include "aio_engine.h"

namespace py = pybind11;
using namespace pybind11::literals;
using dsplug::aio::AioConfig;
using dsplug::aio::AioEngine;
using dsplug::aio::IoError;

static py::tuple to_python(const IoError& e) { return py::make_tuple(e.first, e.second); }

PYBIND11_MODULE(DSPLUG_EXT_NAME, m) {
    m.doc() = "dsplug async_io: O_DIRECT + libaio (or thread pool) file I/O on raw buffers";
    using release = py::call_guard<py::gil_scoped_release>;
    py::class_<AioEngine>(m, "AioEngine", py::module_local())
        .def(py::init([](int64_t block_size, int queue_depth, bool single_submit, bool overlap_events,
                         int intra_op_parallelism, const std::string& backend) {
                 AioConfig c;
                 c.block_size = block_size;
                 c.queue_depth = queue_depth;
                 c.single_submit = single_submit;
                 c.overlap_events = overlap_events;
                 c.intra_op_parallelism = intra_op_parallelism;
                 return new AioEngine(c, backend);
             }),
             "block_size"_a, "queue_depth"_a, "single_submit"_a, "overlap_events"_a, "intra_op_parallelism"_a,
             "backend"_a = "auto")
        .def(
            "submit",
            [](AioEngine& e, bool is_read, uintptr_t buffer, int64_t nbytes, const std::string& filename,
               int64_t file_offset) {
                IoError err;
                {
                    py::gil_scoped_release nogil;
                    err = e.submit(is_read, buffer, nbytes, filename, file_offset);
                }
                return to_python(err);
            },
            "is_read"_a, "buffer"_a, "nbytes"_a, "filename"_a, "file_offset"_a,
            "queue one request; returns (0, '') or (errno, message) when the file cannot be opened")
        .def(
            "wait",
            [](AioEngine& e) {
                std::pair<int64_t, std::vector<IoError>> done;
                {
                    py::gil_scoped_release nogil;
                    done = e.wait();
                }
                py::list errors;
                for (const auto& err : done.second) errors.append(to_python(err));
                return py::make_tuple(done.first, errors);
            },
            "block until all queued requests are done; returns (completed count, [(code, message), ...])")
        .def(
            "run_blocking",
            [](AioEngine& e, bool is_read, uintptr_t buffer, int64_t nbytes, const std::string& filename,
               int64_t file_offset) {
                IoError err;
                {
                    py::gil_scoped_release nogil;
                    err = e.run_blocking(is_read, buffer, nbytes, filename, file_offset);
                }
                return to_python(err);
            },
            "is_read"_a, "buffer"_a, "nbytes"_a, "filename"_a, "file_offset"_a,
            "one request on the calling thread; returns (0, '') or (code, message)")
        .def_property_readonly("backend", &AioEngine::backend);
    m.def("libaio_compiled", &dsplug::aio::libaio_compiled, "whether this build can use libaio");
    m.def("lock_memory", &dsplug::aio::lock_memory, release(), "address"_a, "nbytes"_a, "mlock(); False if refused");
    m.def("unlock_memory", &dsplug::aio::unlock_memory, release(), "address"_a, "nbytes"_a);
    m.attr("direct_io_alignment") = dsplug::aio::kDirectAlignment;
    m.attr("END_OF_FILE") = dsplug::aio::kEndOfFile;
}
