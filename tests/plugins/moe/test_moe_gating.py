"""MoE gating against plain-torch references written here token by token (no cumsum / einsum):
capacity, dropped tokens, expert counts, slots, gate weights and the load-balancing loss."""
from __future__ import annotations

import math

import pytest
import torch

from dsplug.moe.sharded_moe import TopKGate, top1gating, top2gating, topkgating


# ------------------------------------------------------------------ references
def ref_capacity(S, E, factor, min_capacity):
    return max(math.ceil(S / E * factor), min_capacity)


def ref_l_aux(gates, chosen, k):
    """E * sum_e (mean gate prob of e) * (fraction of the k*S choices that are e) ... times 1/k."""
    S, E = gates.shape
    total = 0.0
    for e in range(E):
        me = sum(float(gates[s, e]) for s in range(S)) / S
        ce = sum(1 for s in range(S) if e in chosen[s]) / S
        total += me * ce
    return total * E / k


def ref_route(S, E, choices, keep, weights, capacity):
    """combine[s, e, c] from per-token choices, a keep(s, e) predicate and slot order = token
    order among the kept tokens of each expert (first choices before second choices for top-2:
    ``choices`` is a list of rounds, each round a list over tokens)."""
    combine = torch.zeros(S, E, capacity, dtype=torch.float64)
    next_slot = [0] * E
    for round_ in choices:
        for s in range(S):
            e = round_[s]
            if e is None or not keep(s, e):
                continue
            combine[s, e, next_slot[e]] = weights(s, e)
            next_slot[e] += 1
    return combine


def counts_of(S, E, rounds):
    counts = [0] * E
    for round_ in rounds:
        for s in range(S):
            if round_[s] is not None:
                counts[round_[s]] += 1
    return counts


def check(result, combine_ref, counts_ref, l_aux_ref):
    l_aux, combine, dispatch, exp_counts = result
    assert combine.shape == combine_ref.shape, (combine.shape, combine_ref.shape)
    torch.testing.assert_close(combine.double(), combine_ref, rtol=1e-6, atol=1e-7)
    assert torch.equal(dispatch, combine_ref != 0)
    assert exp_counts.tolist() == counts_ref and exp_counts.device.type == "cpu"
    assert float(l_aux) == pytest.approx(l_aux_ref, rel=1e-5)


def logits_for(S, E, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, E, generator=g) * 2


# ------------------------------------------------------------------ top-1
@pytest.mark.parametrize("S,E,factor,min_capacity", [(16, 4, 1.0, 0), (16, 4, 0.5, 0), (10, 3, 1.0, 7),
                                                     (12, 4, 0.25, 1)])
def test_top1_position_policy_matches_reference(S, E, factor, min_capacity):
    logits = logits_for(S, E, seed=S + E)
    gates = torch.softmax(logits.double(), dim=1)
    first = [int(torch.argmax(gates[s])) for s in range(S)]
    C = ref_capacity(S, E, factor, min_capacity)
    seen = [0] * E

    def keep(s, e):  # the first C tokens routed to e, in token order
        seen[e] += 1
        return seen[e] <= C

    combine = ref_route(S, E, [first], keep, lambda s, e: float(gates[s, e]), C)
    result = top1gating(logits, factor, min_capacity, use_rts=False)
    check(result, combine, counts_of(S, E, [first]), ref_l_aux(gates, [[c] for c in first], 1))
    kept = int(result[2].sum())
    assert kept == sum(min(n, C) for n in counts_of(S, E, [first]))  # the rest were dropped


def test_top1_random_token_selection_keeps_the_largest_draws():
    S, E, factor = 24, 3, 0.5
    logits = logits_for(S, E, seed=5)
    torch.manual_seed(11)
    result = top1gating(logits, factor, 0, use_rts=True)
    torch.manual_seed(11)
    u = torch.rand(S, E)  # RTS: one U(0, 1) draw per (token, expert), the first draw of the call
    gates = torch.softmax(logits.double(), dim=1)
    first = [int(torch.argmax(gates[s])) for s in range(S)]
    C = ref_capacity(S, E, factor, 0)
    kept = set()
    for e in range(E):
        routed = sorted((s for s in range(S) if first[s] == e), key=lambda s: -float(u[s, e]))
        kept |= {(s, e) for s in routed[:C]}
    combine = ref_route(S, E, [first], lambda s, e: (s, e) in kept, lambda s, e: float(gates[s, e]), C)
    check(result, combine, counts_of(S, E, [first]), ref_l_aux(gates, [[c] for c in first], 1))


def test_top1_random_token_selection_is_uniform_over_routed_tokens():
    """Expert j gets tokens 8j..8j+7 and keeps C = 2 of them: with RTS each of the 8 is kept with
    probability 1/4 (many experts in one call: independent trials)."""
    E, per, trials = 200, 8, 10
    logits = torch.full((E * per, E), -5.0)
    logits[torch.arange(E * per), torch.arange(E * per) // per] = 5.0
    kept = torch.zeros(per)
    torch.manual_seed(0)
    for _ in range(trials):
        _, combine, _, counts = top1gating(logits, 0.25, 0, use_rts=True)  # C = ceil(8 * 0.25) = 2
        assert counts.tolist() == [per] * E and combine.shape[-1] == 2
        mask = combine.sum(dim=2).ne(0)  # [S, E]
        assert mask.sum(dim=0).tolist() == [2] * E  # exactly C of each expert's tokens stay
        kept += mask.any(dim=1).float().reshape(E, per).sum(dim=0)
    n = E * trials
    p = kept / n  # how often the i-th routed token of an expert stayed
    assert torch.all((p - 0.25).abs() < 5 * math.sqrt(0.25 * 0.75 / n)), p


def test_top1_without_dropping_uses_the_largest_count_and_keeps_everything():
    S, E = 20, 4
    logits = logits_for(S, E, seed=3)
    logits[:, 2] += 3  # expert 2 is popular
    gates = torch.softmax(logits.double(), dim=1)
    first = [int(torch.argmax(gates[s])) for s in range(S)]
    counts = counts_of(S, E, [first])
    combine = ref_route(S, E, [first], lambda s, e: True, lambda s, e: float(gates[s, e]), max(counts))
    check(top1gating(logits, 1.0, 0, drop_tokens=False), combine, counts, ref_l_aux(gates, [[c] for c in first], 1))


def test_top1_used_token_masks_tokens_out():
    S, E = 12, 3
    logits = logits_for(S, E, seed=8)
    used = torch.tensor([1, 0] * 6)
    gates = torch.softmax(logits.double(), dim=1)
    first = [int(torch.argmax(gates[s])) if used[s] else None for s in range(S)]
    C = ref_capacity(S, E, 2.0, 0)
    combine = ref_route(S, E, [first], lambda s, e: True, lambda s, e: float(gates[s, e]), C)
    chosen = [[c] if c is not None else [] for c in first]
    check(top1gating(logits, 2.0, 0, used_token=used, use_rts=False), combine, counts_of(S, E, [first]),
          ref_l_aux(gates, chosen, 1))


def test_top1_rsample_noise_changes_the_choice_not_the_gate_values():
    S, E = 64, 4
    logits = torch.zeros(S, E)  # every expert equally likely: the noise alone decides
    torch.manual_seed(2)
    _, combine, dispatch, counts = top1gating(logits, 100.0, 0, noisy_gate_policy="RSample", use_rts=False)
    assert (counts > 0).sum() >= 3  # spread, not all on argmax = expert 0
    assert torch.allclose(combine.sum(dim=(1, 2)), torch.full((S,), 0.25))  # the clean softmax value


# ------------------------------------------------------------------ top-2
def top2_reference(logits, factor, min_capacity, drop=True):
    S, E = logits.shape
    gates = torch.softmax(logits.double(), dim=1)
    first = [int(torch.argmax(gates[s])) for s in range(S)]
    second = []
    for s in range(S):
        masked = logits[s].double().clone()
        masked[first[s]] = -float("inf")
        second.append(int(torch.argmax(masked)))
    counts = counts_of(S, E, [first, second])
    C = ref_capacity(S, E, 2 * factor, min_capacity) if drop else max(counts)
    seen = [0] * E
    kept = set()
    for round_ in (first, second):  # every first choice takes a slot before any second choice
        for s in range(S):
            e = round_[s]
            seen[e] += 1
            if seen[e] <= C:
                kept.add((s, e))

    def weight(s, e):
        total = sum(float(gates[s, x]) for x in (first[s], second[s]) if (s, x) in kept)
        return float(gates[s, e]) / max(total, torch.finfo(torch.float32).eps)

    combine = ref_route(S, E, [first, second], lambda s, e: (s, e) in kept, weight, C)
    # DeepSpeed's top-2 loss counts the FIRST choices only: E^2 * mean_e(me * ce)
    return combine, counts, ref_l_aux(gates, [[c] for c in first], 1)


@pytest.mark.parametrize("S,E,factor,min_capacity,drop", [(16, 4, 1.0, 0, True), (16, 4, 0.5, 0, True),
                                                          (9, 3, 0.3, 2, True), (16, 4, 1.0, 0, False)])
def test_top2_matches_reference(S, E, factor, min_capacity, drop):
    logits = logits_for(S, E, seed=S * E)
    logits[:, 0] += 1.5  # unbalanced: expert 0 overflows when capacity is small
    combine, counts, l_aux = top2_reference(logits, factor, min_capacity, drop)
    result = top2gating(logits, factor, min_capacity, drop_tokens=drop, top2_2nd_expert_sampling=False)
    check(result, combine, counts, l_aux)


def test_top2_second_expert_sampling_follows_softmax_of_the_others():
    """Gumbel-max: the 2nd expert is a sample with P(j) = exp(l_j) / sum_{i != first} exp(l_i)."""
    row = torch.tensor([3.0, 1.0, 0.0, -1.0])
    n = 4000
    logits = row.repeat(n, 1)
    torch.manual_seed(5)
    _, combine, _, counts = top2gating(logits, 1.0, 0, drop_tokens=False, top2_2nd_expert_sampling=True)
    assert counts[0] == n  # every first choice is expert 0
    second = counts[1:].double() / n
    expected = torch.softmax(row[1:].double(), dim=0)
    assert torch.all((second - expected).abs() < 5 * torch.sqrt(expected * (1 - expected) / n)), (second, expected)
    # the two kept gates of every token are renormalised to sum to 1
    torch.testing.assert_close(combine.sum(dim=(1, 2)), torch.ones(n))


# ------------------------------------------------------------------ top-k
def topk_reference(logits, k, factor, min_capacity, policy, drop=True):
    S, E = logits.shape
    gates = torch.softmax(logits.double(), dim=1)
    chosen = [set(torch.topk(gates[s], k).indices.tolist()) for s in range(S)]
    counts = [sum(1 for s in range(S) if e in chosen[s]) for e in range(E)]
    C = ref_capacity(S, E, factor * k, min_capacity) if drop else max(counts)
    kept = set()
    for e in range(E):
        routed = [s for s in range(S) if e in chosen[s]]
        if policy == "probs":
            routed = sorted(routed, key=lambda s: -float(gates[s, e]))
        kept |= {(s, e) for s in routed[:C]}

    def weight(s, e):
        total = sum(float(gates[s, x]) for x in chosen[s] if (s, x) in kept)
        return float(gates[s, e]) / total

    rounds = [[e if e in chosen[s] else None for s in range(S)] for e in range(E)]  # slot order: token order
    combine = torch.zeros(S, E, C, dtype=torch.float64)
    for e in range(E):
        slot = 0
        for s in range(S):
            if rounds[e][s] is not None and (s, e) in kept:
                combine[s, e, slot] = weight(s, e)
                slot += 1
    return combine, counts, ref_l_aux(gates, [list(c) for c in chosen], k)


@pytest.mark.parametrize("k,policy,factor,drop", [(3, "probs", 1.0, True), (3, "probs", 0.4, True),
                                                  (3, "position", 0.4, True), (2, "probs", 0.5, True),
                                                  (4, "probs", 1.0, False)])
def test_topk_matches_reference(k, policy, factor, drop):
    S, E = 14, 6
    logits = logits_for(S, E, seed=k * 7)
    logits[:, 1] += 1.0
    combine, counts, l_aux = topk_reference(logits, k, factor, 0, policy, drop)
    check(topkgating(logits, k, factor, 0, drop_tokens=drop, drop_policy=policy), combine, counts, l_aux)


def test_l_aux_is_one_for_a_perfectly_balanced_router():
    """Each expert gets S/E tokens: l_aux = E * sum_e me_e / E = sum_e me_e = 1 whatever the gates."""
    E = 4
    logits = torch.eye(E).repeat(3, 1) * 2.0 + torch.randn(3 * E, E) * 0.1
    assert float(top1gating(logits, 1.0, 0, use_rts=False)[0]) == pytest.approx(1.0, rel=1e-6)
    assert float(topkgating(logits, 2, 1.0, 0)[0]) > 0


# ------------------------------------------------------------------ the gate module
def test_gate_uses_eval_capacity_factor_and_no_noise_in_eval():
    torch.manual_seed(0)
    gate = TopKGate(8, 4, k=1, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0,
                    noisy_gate_policy="Jitter", use_rts=False)
    x = torch.randn(16, 8)
    gate.eval()
    _, combine, _, _ = gate(x)
    assert combine.shape[-1] == ref_capacity(16, 4, 2.0, 0)
    logits = x @ gate.wg.weight.t()
    torch.testing.assert_close(combine, top1gating(logits, 2.0, 0, use_rts=False)[1])
    gate.train()
    _, combine, _, _ = gate(x)
    assert combine.shape[-1] == ref_capacity(16, 4, 0.5, 0)


def test_jitter_multiplies_the_gate_input_within_one_percent():
    torch.manual_seed(1)
    gate = TopKGate(8, 4, noisy_gate_policy="Jitter")
    x = torch.randn(32, 8)
    noisy = gate.logits(x)
    clean = x @ gate.wg.weight.t()
    assert not torch.equal(noisy, clean)
    bound = (x.abs() @ gate.wg.weight.abs().t()) * 1e-2 + 1e-6
    assert torch.all((noisy - clean).abs() <= bound)
    gate.eval()
    torch.testing.assert_close(gate.logits(x), clean)


def test_gate_logits_are_fp32_for_a_bf16_model_and_keep_the_parameter():
    gate = TopKGate(8, 4).to(torch.bfloat16)
    weight = gate.wg.weight
    _, combine, _, _ = gate(torch.randn(6, 8, dtype=torch.bfloat16))
    assert combine.dtype == torch.float32 and gate.wg.weight is weight


@pytest.mark.parametrize("kwargs,message", [
    (dict(noisy_gate_policy="gaussian"), "noisy_gate_policy='gaussian'"),
    (dict(k=5), "k=5 must be between 1 and num_experts"),
    (dict(k=2, noisy_gate_policy="RSample"), "RSample"),
    (dict(capacity_factor=0), "capacity_factor must be > 0"),
    (dict(min_capacity=-1), "min_capacity must be >= 0"),
    (dict(drop_policy="random"), "drop_policy='random'"),
])
def test_gate_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TopKGate(8, 4, **kwargs)


def test_use_tutel_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="Tutel.*not available in dsplug"):
        top1gating(torch.zeros(4, 2), 1.0, 0, use_tutel=True)
