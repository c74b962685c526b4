#include "cpu_adam.h"

#include <cmath>

namespace dsplug {
namespace {

struct AdamUpdate {
    static constexpr int kStates = 2;
    struct Consts {
        float one_minus_beta1, beta2, one_minus_beta2, eps;
        float inv_bias_correction2_sqrt, neg_step_size, weight_decay, decay_factor;
        bool l2_decay, decoupled_decay;
    };
    template <class V>
    struct Step {
        V one_minus_beta1, beta2, one_minus_beta2, eps, inv_bc2_sqrt, neg_step_size, weight_decay, decay_factor;
        bool l2_decay, decoupled_decay;
        explicit Step(const Consts& c)
            : one_minus_beta1(c.one_minus_beta1), beta2(c.beta2), one_minus_beta2(c.one_minus_beta2), eps(c.eps),
              inv_bc2_sqrt(c.inv_bias_correction2_sqrt), neg_step_size(c.neg_step_size),
              weight_decay(c.weight_decay), decay_factor(c.decay_factor), l2_decay(c.l2_decay),
              decoupled_decay(c.decoupled_decay) {}
        inline void operator()(V& p, V g, V& m, V& v) const {
            if (l2_decay) g = fmadd(p, weight_decay, g);
            if (decoupled_decay) p = p * decay_factor;
            m = fmadd(one_minus_beta1, g - m, m);  // = beta1*m + (1-beta1)*g, torch's lerp form
            v = fmadd(v, beta2, (g * g) * one_minus_beta2);
            // sqrt(v_hat) + eps with v_hat = v / bc2; multiplying by 1/sqrt(bc2) (as DeepSpeed)
            // saves a division, which bounds this loop's speed.
            V denom = fmadd(vsqrt(v), inv_bc2_sqrt, eps);
            p = fmadd(m / denom, neg_step_size, p);
        }
    };
};

}  // namespace

void adam_step(const OptimizerBuffers& b, double lr, double beta1, double beta2, double eps,
               double weight_decay, int64_t step, bool bias_correction, bool adamw_mode, int num_threads) {
    if (step < 1) throw std::invalid_argument("adam_step: step must be >= 1, got " + std::to_string(step));
    const double bc1 = bias_correction ? 1.0 - std::pow(beta1, double(step)) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(beta2, double(step)) : 1.0;
    AdamUpdate::Consts c;
    c.one_minus_beta1 = float(1.0 - beta1);
    c.beta2 = float(beta2);
    c.one_minus_beta2 = float(1.0 - beta2);
    c.eps = float(eps);
    c.inv_bias_correction2_sqrt = float(1.0 / std::sqrt(bc2));
    c.neg_step_size = float(-lr / bc1);
    c.weight_decay = float(weight_decay);
    c.decay_factor = float(1.0 - lr * weight_decay);
    c.l2_decay = weight_decay != 0.0 && !adamw_mode;
    c.decoupled_decay = weight_decay != 0.0 && adamw_mode;
    run_optimizer<AdamUpdate>(b, c, num_threads);
}

}  // namespace dsplug
