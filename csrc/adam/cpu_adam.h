// Adam / AdamW step on raw CPU buffers (see dsplug_cpu_optimizer.h for the buffer layout).
#pragma once
#include "dsplug_cpu_optimizer.h"

namespace dsplug {

// One Adam step over `b.n` elements. Matches DeepSpeed's CPU Adam: with `adamw_mode` the weight
// decay is decoupled (param *= 1 - lr * weight_decay), otherwise it is added to the gradient (L2).
// `bias_correction` divides the moments by (1 - beta^step) as in torch.optim.Adam.
void adam_step(const OptimizerBuffers& b, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, bool bias_correction, bool adamw_mode, int num_threads);

}  // namespace dsplug
