// Lion step on raw CPU buffers (see dsplug_cpu_optimizer.h for the buffer layout).
#pragma once
#include "dsplug_cpu_optimizer.h"

namespace dsplug {

// One Lion step (Chen et al. 2023, as DeepSpeed's CPU Lion):
//   update = sign(beta1 * m + (1 - beta1) * g)
//   param  = param * (1 - lr * weight_decay) - lr * update
//   m      = beta2 * m + (1 - beta2) * g
void lion_step(const OptimizerBuffers& b, double lr, double beta1, double beta2, double weight_decay,
               int num_threads);

}  // namespace dsplug
