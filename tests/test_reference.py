"""fastgrpo.reference against per-token computations written out by hand (pure Python floats) and direct formulas."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from fastgrpo.loss import reference

f64 = torch.float64


def hand_grpo_loss(hidden, weight, targets, mask, advantages, old, ref, *, beta, eps_low, eps_high, delta,
                   loss_type, level, temperature, max_completion_length=None, num_items_in_batch=None, bias=None,
                   softcap=None):
    """The GRPO loss of DESIGN.md one token at a time, on Python floats."""
    B, T, _ = hidden.shape
    hidden, weight, mask, advantages = hidden.tolist(), weight.tolist(), mask.tolist(), advantages.tolist()
    bias = [0.0] * len(weight) if bias is None else bias.tolist()
    logp = [[0.0] * T for _ in range(B)]
    for b in range(B):
        for t in range(T):
            z = [sum(h * w for h, w in zip(hidden[b][t], row)) + c for row, c in zip(weight, bias)]
            if softcap is not None:
                z = [softcap * math.tanh(v / softcap) for v in z]
            z = [v / temperature for v in z]
            top = max(z)
            logp[b][t] = z[targets[b][t]] - (top + math.log(sum(math.exp(v - top) for v in z)))
    old = logp if old is None else old.tolist()
    loss_sum, seq_means, kl_sum, low, high = 0.0, [], 0.0, 0, 0
    valid = sum(map(sum, mask))
    for b in range(B):
        count = sum(mask[b])
        seq_log_ratio = sum((logp[b][t] - old[b][t]) * mask[b][t] for t in range(T)) / max(count, 1)
        row_sum = 0.0
        for t in range(T):
            adv = advantages[b] if isinstance(advantages[b], float) else advantages[b][t]
            r = math.exp(seq_log_ratio if level == "sequence" else logp[b][t] - old[b][t])
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            capped = r if delta is None else min(r, delta)
            per_token = -min(capped * adv, clipped * adv)
            if beta:
                d = ref[b][t].item() - logp[b][t]
                kl = math.exp(d) - d - 1
                per_token += beta * kl
                kl_sum += kl * mask[b][t]
            row_sum += per_token * mask[b][t]
            low += mask[b][t] * (r < 1 - eps_low and adv < 0)
            high += mask[b][t] * (r > 1 + eps_high and adv > 0)
        loss_sum += row_sum
        seq_means.append(row_sum / max(count, 1))
    loss = {
        "grpo": sum(seq_means) / B,
        "bnpo": loss_sum / max(valid, 1),
        "dr_grpo": loss_sum / (B * (max_completion_length or 1)),
        "dapo": loss_sum / (num_items_in_batch or max(valid, 1)),
    }[loss_type]
    metrics = {"clip_ratio_low": low / max(valid, 1), "clip_ratio_high": high / max(valid, 1)}
    if beta:
        metrics["kl"] = kl_sum / max(valid, 1)
    return loss, metrics


def random_problem(seed, B=2, T=4, H=5, V=7, dtype=f64):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=gen, dtype=dtype)
    weight = torch.randn(V, H, generator=gen, dtype=dtype)
    bias = torch.randn(V, generator=gen, dtype=dtype)
    # The least likely token (softcap and temperature keep the order): logp <= -log V, so old = logp - log_ratio
    # below is a log-prob (<= 0, as the loss checks) for every log_ratio >= -log V.
    targets = (hidden @ weight.T + bias).argmin(-1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)[:B, :T]
    advantages = torch.tensor([0.7, -1.3], dtype=dtype)[:B]
    logps = reference.linear_logprobs(hidden, weight, targets, 0.7, bias)
    # log(ratio) per token: with A = (0.7, -1.3) and eps (0.2, 0.28), token level clips 1 high (row 0: e^0.5) and
    # 2 low (row 1: e^-0.6, e^-0.3); sequence level clips row 1 low (e^-0.283 = 0.75 over its 3 valid tokens).
    log_ratio = torch.tensor([[0.5, -0.5, 0.1, 0.9], [-0.6, 0.4, 0.05, -0.3]], dtype=dtype)[:B, :T]
    old = logps - log_ratio
    ref = (logps + 0.5 * torch.randn(B, T, generator=gen, dtype=dtype)).clamp(max=0.0)
    return hidden, weight, bias, targets, mask, advantages, old, ref


LOSS_KWARGS = {"grpo": {}, "bnpo": {}, "dr_grpo": {"max_completion_length": 6}, "dapo": {"num_items_in_batch": 9}}


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_grpo_loss_matches_the_hand_computation(loss_type, level):
    hidden, weight, bias, targets, mask, advantages, old, ref = random_problem(seed=1)
    settings = dict(beta=0.04, eps_low=0.2, eps_high=0.28, delta=None, temperature=0.7)
    loss, metrics = reference.grpo_loss(
        hidden, weight, targets, mask, advantages, old_logps=old, ref_logps=ref, beta=0.04, epsilon_low=0.2,
        epsilon_high=0.28, loss_type=loss_type, importance_sampling_level=level, temperature=0.7, bias=bias,
        **LOSS_KWARGS[loss_type],
    )
    want, want_metrics = hand_grpo_loss(
        hidden, weight, targets.tolist(), mask, advantages, old, ref, loss_type=loss_type, level=level,
        bias=bias, **settings, **LOSS_KWARGS[loss_type],
    )
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    for key, value in want_metrics.items():
        assert metrics[key].item() == pytest.approx(value, rel=1e-10, abs=1e-12), key
    want_clip = want_metrics["clip_ratio_low"] + want_metrics["clip_ratio_high"]
    assert metrics["clip_ratio"].item() == pytest.approx(want_clip)
    known = {"token": (2 / 6, 1 / 6), "sequence": (3 / 6, 0.0)}[level]  # (low, high): see random_problem
    assert (want_metrics["clip_ratio_low"], want_metrics["clip_ratio_high"]) == pytest.approx(known)


def test_grpo_loss_soft_caps_the_logits_before_the_temperature():
    hidden, weight, bias, targets, mask, advantages, old, ref = random_problem(seed=7)
    common = dict(beta=0.04, delta=None, temperature=0.7, bias=bias, loss_type="bnpo")
    loss, metrics = reference.grpo_loss(
        hidden, weight, targets, mask, advantages, old_logps=old, ref_logps=ref, epsilon_low=0.2,
        epsilon_high=0.28, importance_sampling_level="token", softcap=1.5, **common,
    )
    want, want_metrics = hand_grpo_loss(
        hidden, weight, targets.tolist(), mask, advantages, old, ref, eps_low=0.2, eps_high=0.28, level="token",
        softcap=1.5, **common,
    )
    uncapped, _ = hand_grpo_loss(
        hidden, weight, targets.tolist(), mask, advantages, old, ref, eps_low=0.2, eps_high=0.28, level="token",
        **common,
    )
    assert loss.item() == pytest.approx(want, rel=1e-10, abs=1e-12)
    assert metrics["kl"].item() == pytest.approx(want_metrics["kl"], rel=1e-10, abs=1e-12)
    assert abs(want - uncapped) > 1e-2  # logits of std ~2 here: a cap of 1.5 bends them


def test_grpo_loss_on_policy_and_per_token_advantages():
    hidden, weight, _, targets, mask, _, _, _ = random_problem(seed=2)
    per_token_adv = torch.randn(2, 4, generator=torch.Generator().manual_seed(3), dtype=f64)
    loss, metrics = reference.grpo_loss(hidden, weight, targets, mask, per_token_adv, loss_type="grpo")
    want, _ = hand_grpo_loss(hidden, weight, targets.tolist(), mask, per_token_adv, None, None, beta=0.0,
                             eps_low=0.2, eps_high=0.2, delta=None, loss_type="grpo", level="token", temperature=1.0)
    assert loss.item() == pytest.approx(want, rel=1e-12)  # on-policy: ratio 1, loss = -masked mean of A
    assert metrics["clip_ratio"].item() == 0.0 and "kl" not in metrics


def identity_problem(ratios, advantages, mask):
    """Tokens whose ratios to old_logps are exactly `ratios`: logits = hidden through an identity lm_head. Each
    target is the least likely of the 3 tokens (logp <= -log 3), so old_logps are log-probs (<= 0, as the loss
    checks) for ratios >= 1/3."""
    B, T = len(ratios), len(ratios[0])
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, 3, generator=gen, dtype=f64)
    weight = torch.eye(3, dtype=f64)
    targets = hidden.argmin(-1)
    logps = reference.linear_logprobs(hidden, weight, targets)
    old = logps - torch.tensor(ratios, dtype=f64).log()
    return hidden, weight, targets, torch.tensor(mask, dtype=torch.bool), torch.tensor(advantages, dtype=f64), old


def test_clip_ratio_with_known_clipping_on_both_sides():
    # eps_low 0.2, eps_high 0.28. Row 0 (A > 0): 1.3 and 1.5 clip high. Row 1 (A < 0): 0.5 and 0.79 clip low;
    # 1.5 is masked out. The others sit inside the range or on the side the min() does not clip.
    ratios = [[0.5, 1.0, 1.3, 1.5], [0.5, 0.79, 1.2, 1.5]]
    hidden, weight, targets, mask, advantages, old = identity_problem(ratios, [1.0, -1.0], [[1] * 4, [1, 1, 1, 0]])
    loss, metrics = reference.grpo_loss(hidden, weight, targets, mask, advantages, old_logps=old, epsilon_low=0.2,
                                        epsilon_high=0.28, loss_type="bnpo")
    assert metrics["clip_ratio_high"].item() == pytest.approx(2 / 7)
    assert metrics["clip_ratio_low"].item() == pytest.approx(2 / 7)
    assert metrics["clip_ratio"].item() == pytest.approx(4 / 7)
    per_token = [-0.5, -1.0, -1.28, -1.28, 0.8, 0.8, 1.2]  # -min(r A, clip(r) A) on the 7 valid tokens
    assert loss.item() == pytest.approx(sum(per_token) / 7, rel=1e-12)


def test_clip_ratio_at_sequence_level():
    # Sequence ratio = exp(mean log-ratio over valid tokens): row 0 sqrt(2 * 1.28) = 1.6 clips, row 1 stays 1.
    ratios = [[2.0, 1.28, 9.0], [0.5, 2.0, 1.0]]
    hidden, weight, targets, mask, advantages, old = identity_problem(ratios, [1.0, 1.0], [[1, 1, 0], [1, 1, 1]])
    loss, metrics = reference.grpo_loss(hidden, weight, targets, mask, advantages, old_logps=old, epsilon_low=0.2,
                                        epsilon_high=0.28, loss_type="grpo", importance_sampling_level="sequence")
    # One ratio per sequence: the clip shares count sequences, as TRL's global_masked_mean does.
    assert metrics["clip_ratio_high"].item() == pytest.approx(1 / 2)
    assert metrics["clip_ratio_low"].item() == 0.0
    assert metrics["clip_ratio_high_max"].item() == 1.0 and metrics["clip_ratio_low_min"].item() == 0.0
    assert loss.item() == pytest.approx((-1.28 - 1.0) / 2, rel=1e-12)


def test_delta_caps_the_unclipped_ratio():
    # A < 0 and r = 3: the min() takes r A, unbounded without delta; delta = 2 caps it at 2 A.
    hidden, weight, targets, mask, advantages, old = identity_problem([[3.0, 1.0]], [-1.0], [[1, 1]])
    common = dict(old_logps=old, epsilon_low=0.2, epsilon_high=0.28, loss_type="bnpo")
    uncapped, _ = reference.grpo_loss(hidden, weight, targets, mask, advantages, **common)
    capped, metrics = reference.grpo_loss(hidden, weight, targets, mask, advantages, delta=2.0, **common)
    assert uncapped.item() == pytest.approx((3.0 + 1.0) / 2, rel=1e-12)
    assert capped.item() == pytest.approx((2.0 + 1.0) / 2, rel=1e-12)
    assert metrics["clip_ratio"].item() == 0.0


def test_temperature_divides_the_logits():
    hidden, weight, bias, targets, mask, advantages, old, ref = random_problem(seed=4)
    common = dict(old_logps=old, ref_logps=ref, beta=0.1, loss_type="grpo")
    hot, hot_metrics = reference.grpo_loss(hidden, weight, targets, mask, advantages, temperature=0.5, bias=bias,
                                           **common)
    scaled, scaled_metrics = reference.grpo_loss(hidden, weight / 0.5, targets, mask, advantages, bias=bias / 0.5,
                                                 **common)
    torch.testing.assert_close(hot, scaled, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hot_metrics["kl"], scaled_metrics["kl"], rtol=1e-12, atol=1e-12)
    cold, _ = reference.grpo_loss(hidden, weight, targets, mask, advantages, temperature=2.0, bias=bias, **common)
    assert not torch.allclose(hot, cold)


def test_grpo_loss_upcasts_on_request():
    hidden, weight, bias, targets, mask, advantages, old, ref = random_problem(seed=5)
    single = [t.float() for t in (hidden, weight, advantages, old, ref)]
    loss64, _ = reference.grpo_loss(hidden, weight, targets, mask, advantages, old_logps=old, ref_logps=ref, beta=0.1)
    loss, _ = reference.grpo_loss(single[0], single[1], targets, mask, single[2], old_logps=single[3],
                                  ref_logps=single[4], beta=0.1, upcast=f64)
    assert loss.dtype == f64
    torch.testing.assert_close(loss, loss64, rtol=1e-6, atol=1e-7)  # only the inputs were rounded to fp32


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"loss_type": "sum"}, "loss_type"),
        ({"importance_sampling_level": "batch"}, "importance_sampling_level"),
        ({"beta": 0.1}, "ref_logps"),
        ({"loss_type": "dr_grpo"}, "max_completion_length"),
        ({"temperature": 0.0}, "temperature"),
        ({"softcap": 0.0}, "softcap"),
        ({"softcap": float("inf")}, "softcap"),
        ({"old_logps": torch.zeros(2, 3, dtype=f64)}, "old_logps"),
    ],
)
def test_grpo_loss_bad_arguments(kwargs, name):
    hidden, weight, _, targets, mask, advantages, _, _ = random_problem(seed=6)
    with pytest.raises(ValueError, match=f"^{name}: "):
        reference.grpo_loss(hidden, weight, targets, mask, advantages, **kwargs)
    with pytest.raises(ValueError, match="^target_ids: "):
        reference.grpo_loss(hidden, weight, targets + 7, mask, advantages)


# --- linear_logprobs ---------------------------------------------------------------------------------------------


@given(
    st.integers(1, 4), st.integers(2, 9), st.integers(0, 2**31 - 1), st.sampled_from([0.5, 1.0, 3.0]),
    st.sampled_from([None, 0.5, 30.0]),
)
def test_linear_logprobs_on_explicit_logits(rows, vocab, seed, temperature, softcap):
    gen = torch.Generator().manual_seed(seed)
    logits = 5 * torch.randn(rows, vocab, generator=gen, dtype=f64)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    capped = logits if softcap is None else softcap * torch.tanh(logits / softcap)  # 0.5: saturated
    want = torch.log_softmax(capped / temperature, -1)
    # hidden = the logits through an identity lm_head; and row 0's logits as the bias of a zero hidden state.
    logps, entropy = reference.linear_logprobs(logits, torch.eye(vocab, dtype=f64), targets, temperature,
                                               return_entropy=True, softcap=softcap)
    from_bias = reference.linear_logprobs(torch.zeros(rows, 2, dtype=f64), torch.randn(vocab, 2, dtype=f64),
                                          targets, temperature, bias=logits[0], softcap=softcap)
    torch.testing.assert_close(logps, want[torch.arange(rows), targets], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(from_bias, want[0][targets], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(entropy, -(want.exp() * want).sum(-1), rtol=1e-12, atol=1e-12)


def test_linear_logprobs_keeps_leading_dims_and_dtype():
    hidden = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    weight = torch.randn(5, 4, dtype=torch.bfloat16)
    targets = torch.randint(0, 5, (2, 3))
    assert reference.linear_logprobs(hidden, weight, targets).shape == (2, 3)
    assert reference.linear_logprobs(hidden, weight, targets).dtype == torch.bfloat16
    assert reference.linear_logprobs(hidden, weight, targets, upcast=f64).dtype == f64


# --- Layers --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_its_formula(offset):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen, dtype=f64) * 4
    weight = torch.randn(8, generator=gen, dtype=f64)
    got = reference.rms_norm(x, weight, eps=1e-6, offset=offset)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) / 8 + 1e-6) * (weight + offset)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, F.rms_norm(x, (8,), weight + offset, eps=1e-6), rtol=1e-12, atol=1e-12)


def test_apply_rotary_rotates_each_half_pair_by_its_angle():
    gen = torch.Generator().manual_seed(0)
    B, Hq, Hk, T, D = 2, 4, 2, 3, 6
    q = torch.randn(B, Hq, T, D, generator=gen, dtype=f64)
    k = torch.randn(B, Hk, T, D, generator=gen, dtype=f64)
    angles = torch.randn(B, T, D // 2, generator=gen, dtype=f64)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # HF layout: [B, T, D]
    q_rot, k_rot = reference.apply_rotary(q, k, cos, sin)
    # Pair (i, i + D/2) is the complex number x_i + j x_{i+D/2}, multiplied by exp(j angle_i).
    rotation = torch.polar(torch.ones_like(angles), angles).unsqueeze(1)  # [B, 1, T, D/2]
    for x, x_rot in ((q, q_rot), (k, k_rot)):
        z = torch.complex(x[..., : D // 2], x[..., D // 2 :]) * rotation
        torch.testing.assert_close(x_rot, torch.cat([z.real, z.imag], -1), rtol=1e-12, atol=1e-12)


def test_swiglu_and_geglu_match_their_formulas():
    gen = torch.Generator().manual_seed(0)
    gate, up = (4 * torch.randn(5, 7, generator=gen, dtype=f64) for _ in range(2))
    swish = gate / (1 + torch.exp(-gate))
    gelu_tanh = 0.5 * gate * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)))
    torch.testing.assert_close(reference.swiglu(gate, up), swish * up, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(reference.geglu(gate, up), gelu_tanh * up, rtol=1e-12, atol=1e-12)
