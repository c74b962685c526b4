#include "cpu_lion.h"

namespace dsplug {
namespace {

struct LionUpdate {
    static constexpr int kStates = 1;
    struct Consts {
        float beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, decay_factor;
        bool has_decay;
    };
    template <class V>
    struct Step {
        V beta1, one_minus_beta1, beta2, one_minus_beta2, neg_lr, decay_factor;
        bool has_decay;
        explicit Step(const Consts& c)
            : beta1(c.beta1), one_minus_beta1(c.one_minus_beta1), beta2(c.beta2), one_minus_beta2(c.one_minus_beta2),
              neg_lr(c.neg_lr), decay_factor(c.decay_factor), has_decay(c.has_decay) {}
        inline void operator()(V& p, V g, V& m) const {
            // No fused multiply-add in the interpolation: its sign decides a whole +-lr step, so it
            // is computed exactly as the two-product reference (m*beta1 + g*(1-beta1)) rounds it.
            V update = vsign(m * beta1 + g * one_minus_beta1);
            if (has_decay) p = p * decay_factor;
            p = fmadd(update, neg_lr, p);  // update is exactly -1, 0 or 1: no rounding difference
            m = m * beta2 + g * one_minus_beta2;
        }
    };
};

}  // namespace

void lion_step(const OptimizerBuffers& b, double lr, double beta1, double beta2, double weight_decay,
               int num_threads) {
    LionUpdate::Consts c;
    c.beta1 = float(beta1);
    c.one_minus_beta1 = float(1.0 - beta1);
    c.beta2 = float(beta2);
    c.one_minus_beta2 = float(1.0 - beta2);
    c.neg_lr = float(-lr);
    c.decay_factor = float(1.0 - lr * weight_decay);
    c.has_decay = weight_decay != 0.0;
    run_optimizer<LionUpdate>(b, c, num_threads);
}

}  // namespace dsplug
