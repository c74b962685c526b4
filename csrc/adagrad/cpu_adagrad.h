// Adagrad step on raw CPU buffers (see dsplug_cpu_optimizer.h for the buffer layout).
#pragma once
#include "dsplug_cpu_optimizer.h"

namespace dsplug {

// One Adagrad step, as torch.optim.Adagrad: grad += weight_decay * param; sum += grad^2;
// param -= clr * grad / (sqrt(sum) + eps), with clr = lr / (1 + (step - 1) * lr_decay).
void adagrad_step(const OptimizerBuffers& b, double lr, double eps, double weight_decay, double lr_decay,
                  int64_t step, int num_threads);

}  // namespace dsplug
