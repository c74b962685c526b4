// Python bindings of the CPU optimizer ops (cpu_adam, cpu_adagrad, cpu_lion), one extension
// module for the three: pybind11's fixed compile cost is paid once. Arguments are raw data
// pointers (ints) of tensors the Python wrappers (dsplug.ops.native.cpu_optim) have checked;
// each step releases the GIL for its whole duration.
#include <pybind11/pybind11.h>

#include "cpu_adagrad.h"
#include "cpu_adam.h"
#include "cpu_lion.h"

namespace py = pybind11;
using namespace pybind11::literals;
using dsplug::OptimizerBuffers;

static OptimizerBuffers buffers(uintptr_t param, uintptr_t grad, uintptr_t state1, uintptr_t state2, uintptr_t out,
                                int64_t n, int param_dtype, int state_dtype, int out_dtype) {
    OptimizerBuffers b;
    b.param = param; b.grad = grad; b.state1 = state1; b.state2 = state2; b.out = out; b.n = n;
    b.param_dtype = param_dtype; b.state_dtype = state_dtype; b.out_dtype = out_dtype;
    return b;
}

static void adam_step_py(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq, uintptr_t out,
                         int64_t n, int param_dtype, int state_dtype, int out_dtype, double lr, double beta1,
                         double beta2, double eps, double weight_decay, int64_t step, bool bias_correction,
                         bool adamw_mode, int num_threads) {
    dsplug::adam_step(buffers(param, grad, exp_avg, exp_avg_sq, out, n, param_dtype, state_dtype, out_dtype), lr,
                      beta1, beta2, eps, weight_decay, step, bias_correction, adamw_mode, num_threads);
}

static void adagrad_step_py(uintptr_t param, uintptr_t grad, uintptr_t state_sum, uintptr_t out, int64_t n,
                            int param_dtype, int state_dtype, int out_dtype, double lr, double eps,
                            double weight_decay, double lr_decay, int64_t step, int num_threads) {
    dsplug::adagrad_step(buffers(param, grad, state_sum, 0, out, n, param_dtype, state_dtype, out_dtype), lr, eps,
                         weight_decay, lr_decay, step, num_threads);
}

static void lion_step_py(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t out, int64_t n,
                         int param_dtype, int state_dtype, int out_dtype, double lr, double beta1, double beta2,
                         double weight_decay, int num_threads) {
    dsplug::lion_step(buffers(param, grad, exp_avg, 0, out, n, param_dtype, state_dtype, out_dtype), lr, beta1,
                      beta2, weight_decay, num_threads);
}

PYBIND11_MODULE(DSPLUG_EXT_NAME, m) {
    m.doc() = "dsplug CPU optimizer ops: SIMD, multithreaded Adam/AdamW, Adagrad and Lion steps on raw buffers";
    using release = py::call_guard<py::gil_scoped_release>;
    m.def("simd_isa", [] { return std::string(dsplug::simd_isa()); }, "instruction set the kernels were built for");
    m.def("omp_team_library", [] { return std::string(dsplug::omp_team_library()); },
          "path of the OpenMP runtime whose thread team runs the kernels (torch's), or '' for the op's own threads");
    m.def("adam_step", &adam_step_py, release(), "param"_a, "grad"_a, "exp_avg"_a, "exp_avg_sq"_a, "out"_a, "n"_a,
          "param_dtype"_a, "state_dtype"_a, "out_dtype"_a, "lr"_a, "beta1"_a, "beta2"_a, "eps"_a, "weight_decay"_a,
          "step"_a, "bias_correction"_a, "adamw_mode"_a, "num_threads"_a);
    m.def("adagrad_step", &adagrad_step_py, release(), "param"_a, "grad"_a, "state_sum"_a, "out"_a, "n"_a,
          "param_dtype"_a, "state_dtype"_a, "out_dtype"_a, "lr"_a, "eps"_a, "weight_decay"_a, "lr_decay"_a, "step"_a,
          "num_threads"_a);
    m.def("lion_step", &lion_step_py, release(), "param"_a, "grad"_a, "exp_avg"_a, "out"_a, "n"_a, "param_dtype"_a,
          "state_dtype"_a, "out_dtype"_a, "lr"_a, "beta1"_a, "beta2"_a, "weight_decay"_a, "num_threads"_a);
}
