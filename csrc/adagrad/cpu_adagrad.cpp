#include "cpu_adagrad.h"

namespace dsplug {
namespace {

struct AdagradUpdate {
    static constexpr int kStates = 1;
    struct Consts {
        float neg_clr, eps, weight_decay;
        bool has_decay;
    };
    template <class V>
    struct Step {
        V neg_clr, eps, weight_decay;
        bool has_decay;
        explicit Step(const Consts& c) : neg_clr(c.neg_clr), eps(c.eps), weight_decay(c.weight_decay), has_decay(c.has_decay) {}
        inline void operator()(V& p, V g, V& sum) const {
            if (has_decay) g = fmadd(p, weight_decay, g);
            sum = fmadd(g, g, sum);
            V std_dev = vsqrt(sum) + eps;
            p = fmadd(g / std_dev, neg_clr, p);
        }
    };
};

}  // namespace

void adagrad_step(const OptimizerBuffers& b, double lr, double eps, double weight_decay, double lr_decay,
                  int64_t step, int num_threads) {
    if (step < 1) throw std::invalid_argument("adagrad_step: step must be >= 1, got " + std::to_string(step));
    AdagradUpdate::Consts c;
    c.neg_clr = float(-lr / (1.0 + double(step - 1) * lr_decay));
    c.eps = float(eps);
    c.weight_decay = float(weight_decay);
    c.has_decay = weight_decay != 0.0;
    run_optimizer<AdagradUpdate>(b, c, num_threads);
}

}  // namespace dsplug
