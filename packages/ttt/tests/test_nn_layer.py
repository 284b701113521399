"""ttt.nn.TTTLinear and TTTMLP against a plain float64 loop written from the official layers'
math.

The loop below uses nothing of ttt: projections, the official rotary (permute to the
half-split layout, rotate_half, permute back; angles in float32 as the official code), the
learning rates of ``get_eta``, and per mini-batch the inner step in its primal form, token by
token, with the per-token inner gradient from autograd (of the inner model's output for
TTT-Linear, of all four MLP parameters for TTT-MLP). Outputs and every parameter gradient
must agree to float64 precision.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ttt
from ttt.nn import TTTMLP, TTTLinear
from ttt.nn.rotary import apply_rotary, rotary_cos_sin

EPS = 1e-6
FP64_RTOL = 1e-9


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _official_rotary(t, positions, theta):
    """``t [B, H, T, D]``: permute_qk, HF rotate_half rotation, undo_permute_qk."""
    B, H, T, D = t.shape
    inv_freq = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
    freqs = positions.float()[:, None] * inv_freq[None, :]          # float32, as official
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(t.dtype), emb.sin().to(t.dtype)
    t = t.reshape(B, H, T, D // 2, 2).transpose(3, 4).reshape(B, H, T, D)
    half = torch.cat((-t[..., D // 2:], t[..., :D // 2]), dim=-1)
    t = t * cos + half * sin
    return t.reshape(B, H, T, 2, D // 2).transpose(3, 4).reshape(B, H, T, D)


def _ln(x, weight, bias, eps=EPS):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * weight + bias


def _inner_grads(z, target, weight, bias):
    """Per-token gradient of 1/2 ||LN(z) w + b - target||^2 with respect to z (autograd;
    each token's loss depends on its own row only), differentiable."""
    if not z.requires_grad:
        z = z.detach().requires_grad_(True)
    loss = 0.5 * ((_ln(z, weight, bias) - target) ** 2).sum()
    (grad,) = torch.autograd.grad(loss, z, create_graph=True)
    return grad


def _inner_sequence(q, k, v, e, lr, W, hb, norm_w, norm_b, K):
    """One batch of equal-length sequences. q, k, v [B, H, T, D]; e [T]; lr [B, H, T];
    W [B, H, D, D]; hb [B, H, 1, D]. Primal form: token i reads the state stepped with
    eta[i, j] = e_i * lr_j over the tokens j <= i of its mini-batch."""
    T = q.shape[2]
    outs = []
    for start in range(0, T, K):
        stop = min(start + K, T)
        kk, vv = k[:, :, start:stop], v[:, :, start:stop]
        g = _inner_grads(kk @ W + hb, vv - kk, norm_w, norm_b)       # [B, H, L, D]
        step_W = torch.zeros_like(W)
        step_b = torch.zeros_like(hb)
        for i in range(stop - start):
            row = lr[:, :, start + i, None, None]                    # [B, H, 1, 1]
            step_W = step_W + row * kk[:, :, i, :, None] * g[:, :, i, None, :]
            step_b = step_b + row * g[:, :, i:i + 1]
            e_i = e[(start + i) % K]
            z = q[:, :, start + i:start + i + 1] @ (W - e_i * step_W) + (hb - e_i * step_b)
            outs.append(q[:, :, start + i:start + i + 1] + _ln(z, norm_w, norm_b))
        e_last = e[(stop - 1) % K]
        W, hb = W - e_last * step_W, hb - e_last * step_b
    return torch.cat(outs, dim=2)


def _mlp(x, W1, b1, W2, b2):
    return F.gelu(x @ W1 + b1, approximate="tanh") @ W2 + b2


def _mlp_inner_sequence(q, k, v, e, lr, state, norm_w, norm_b, K):
    """TTT-MLP's inner steps, primal form: token i reads the mini-batch's starting state
    (W1, b1, W2, b2, each [B, H, ...]) stepped by e_i * sum_{j <= i} lr_j * grad_j, grad_j
    the gradient of token j's inner loss at that state (autograd, differentiable)."""
    T = q.shape[2]
    outs = []
    for start in range(0, T, K):
        stop = min(start + K, T)
        step = [torch.zeros_like(s) for s in state]
        for j in range(start, stop):
            kj, vj = k[:, :, j:j + 1], v[:, :, j:j + 1]
            loss = 0.5 * ((_ln(_mlp(kj, *state), norm_w, norm_b) - (vj - kj)) ** 2).sum()
            grads = torch.autograd.grad(loss, state, create_graph=True)
            step = [a + lr[:, :, j, None, None] * g for a, g in zip(step, grads)]
            e_j = e[j % K]
            z = _mlp(q[:, :, j:j + 1], *(s - e_j * a for s, a in zip(state, step)))
            outs.append(q[:, :, j:j + 1] + _ln(z, norm_w, norm_b))
        e_last = e[(stop - 1) % K]
        state = [s - e_last * a for s, a in zip(state, step)]
    return torch.cat(outs, dim=2)


def official_loop(p: dict, x: torch.Tensor, K: int, theta: float, base_lr: float,
                  use_gate: bool) -> torch.Tensor:
    """The official TTT-Linear forward (no cache) for one batch ``x [B, T, C]``; TTT-MLP's
    where ``p`` holds ``W2``."""
    B, T, C = x.shape
    H, D = p["W1"].shape[0], p["W1"].shape[1]

    def heads(t):
        return t.reshape(B, T, H, D).transpose(1, 2)                 # [B, H, T, D]

    q, k, v = (heads(x @ p[f"{n}_proj.weight"].T) for n in "qkv")
    positions = torch.arange(T) % K
    q, k = _official_rotary(q, positions, theta), _official_rotary(k, positions, theta)
    lr = torch.einsum("btc,hdc->bhtd", x, p["learnable_ttt_lr_weight"])
    lr = base_lr * torch.sigmoid(lr + p["learnable_ttt_lr_bias"].reshape(1, H, 1, 1)) / D
    e = torch.clamp_min(1.0 / torch.arange(1, K + 1, dtype=x.dtype) + p["learnable_token_idx"],
                        0.0)
    norm_w = p["ttt_norm_weight"].reshape(H, 1, D)
    norm_b = p["ttt_norm_bias"].reshape(H, 1, D)
    if "W2" in p:
        state = [p[n].unsqueeze(0).expand(B, -1, -1, -1) for n in ("W1", "b1", "W2", "b2")]
        out = _mlp_inner_sequence(q, k, v, e, lr[..., 0], state, norm_w, norm_b, K)
    else:
        W = p["W1"].unsqueeze(0).expand(B, -1, -1, -1)
        hb = p["b1"].unsqueeze(0).expand(B, -1, -1, -1)
        out = _inner_sequence(q, k, v, e, lr[..., 0], W, hb, norm_w, norm_b, K)
    y = F.layer_norm(out.transpose(1, 2).reshape(B, T, C), (C,), p["post_norm.weight"],
                     p["post_norm.bias"], EPS)
    if use_gate:
        y = F.gelu(x @ p["g_proj.weight"].T, approximate="tanh") * y
    return y @ p["o_proj.weight"].T


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rotary_is_the_official_one_bitwise(dtype):
    x = torch.randn(2, 37, 3, 16).to(dtype)                          # [B, T, H, D]
    positions = torch.arange(37) % 16
    cos, sin = rotary_cos_sin(positions, 16, 10000.0, dtype)
    got = apply_rotary(x, cos, sin)
    expected = _official_rotary(x.transpose(1, 2), positions, 10000.0).transpose(1, 2)
    assert torch.equal(got, expected)


def _randomized(layer: TTTLinear, seed: int) -> TTTLinear:
    """Every parameter moved off its initial value (no zeros, no ones); some token_idx
    offsets below -1/(i+1), so the clamp at 0 is exercised."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in layer.parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=gen, dtype=param.dtype))
        layer.learnable_token_idx[1] = -0.7
        layer.learnable_ttt_lr_weight.mul_(5.0)
    return layer


def _case(width=16, heads=2, K=4, use_gate=False, theta=10000.0, base_lr=1.0, seed=0,
          kind=TTTLinear):
    layer = kind(width, heads, K, rope_theta=theta, ttt_base_lr=base_lr, use_gate=use_gate,
                 dtype=torch.float64)
    return _randomized(layer, seed)


def _grads_of(outputs, probe, tensors):
    return torch.autograd.grad((outputs * probe).sum(), tensors)


def _assert_matches_the_loop(got, expected, probe, x, layer, params, rtol=FP64_RTOL):
    """The layer's output ``got`` and its gradients (of x and every parameter, along
    ``probe``) match the official loop's (``expected``, of the copies ``params``)."""
    assert _rel(got, expected) < rtol
    have = _grads_of(got, probe, [x, *layer.parameters()])
    want = _grads_of(expected, probe, [x, *params.values()])
    for name, g_have, g_want in zip(["x", *params], have, want):
        assert _rel(g_have, g_want) < rtol, name


MLP_RTOL = 1e-12


@pytest.mark.parametrize("kind", [TTTLinear, TTTMLP], ids=["linear", "mlp"])
@pytest.mark.parametrize("T", [12, 11, 3])
@pytest.mark.parametrize("use_gate", [False, True])
def test_layer_matches_official_loop_fp64(T, use_gate, kind):
    layer = _case(K=4, use_gate=use_gate, theta=500.0, base_lr=0.7, seed=T, kind=kind)
    gen = torch.Generator().manual_seed(100 + T)
    x = torch.randn(2, T, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(2, T, 16, generator=gen, dtype=torch.float64)

    params = {n: t.detach().clone().requires_grad_(True) for n, t in layer.named_parameters()}
    expected = official_loop(params, x, 4, 500.0, 0.7, use_gate)
    _assert_matches_the_loop(layer(x), expected, probe, x, layer, params,
                             MLP_RTOL if kind is TTTMLP else FP64_RTOL)


def test_gradients_reach_every_parameter():
    layer = _case(use_gate=True)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    layer(x).square().sum().backward()
    for name, param in layer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", [TTTLinear, TTTMLP], ids=["linear", "mlp"])
def test_packed_sequences_restart_positions_and_state(kind):
    layer = _case(K=4, seed=3, kind=kind)
    gen = torch.Generator().manual_seed(7)
    lengths = [6, 9, 1]
    x = torch.randn(1, sum(lengths), 16, generator=gen, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(1, sum(lengths), 16, generator=gen, dtype=torch.float64)
    cu = torch.tensor([0, 6, 15, 16])
    packed = layer(x, cu_seqlens=cu)

    params = {n: t.detach().clone().requires_grad_(True) for n, t in layer.named_parameters()}
    pieces = [official_loop(params, x[:, a:b], 4, 10000.0, 1.0, False)
              for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]
    _assert_matches_the_loop(packed, torch.cat(pieces, dim=1), probe, x, layer, params)


def test_state_dict_has_the_official_names_and_shapes():
    layer = TTTLinear(64, 4, 16, use_gate=True)
    shapes = {name: tuple(t.shape) for name, t in layer.state_dict().items()}
    assert shapes == {
        "q_proj.weight": (64, 64), "k_proj.weight": (64, 64), "v_proj.weight": (64, 64),
        "o_proj.weight": (64, 64), "g_proj.weight": (64, 64),
        "learnable_ttt_lr_weight": (4, 1, 64), "learnable_ttt_lr_bias": (4, 1),
        "learnable_token_idx": (16,), "ttt_norm_weight": (4, 16), "ttt_norm_bias": (4, 16),
        "W1": (4, 16, 16), "b1": (4, 1, 16), "post_norm.weight": (64,),
        "post_norm.bias": (64,)}
    assert torch.equal(layer.token_idx, 1.0 / torch.arange(1, 17))
    other = TTTLinear(64, 4, 16, use_gate=True)
    other.load_state_dict({k: torch.randn_like(t) for k, t in layer.state_dict().items()})
    assert not TTTLinear(64, 4, 16).state_dict().keys() & {"g_proj.weight", "token_idx"}


def test_mlp_state_dict_has_the_official_names_and_shapes():
    """TTTMLP's parameters are TTTLinear's but the inner model's, W1 [H, D, 4D], b1
    [H, 1, 4D], W2 [H, 4D, D], b2 [H, 1, D]; the official initialisation (weights N(0,
    0.02), biases zero)."""
    torch.manual_seed(0)
    mlp, linear = TTTMLP(256, 4, 16, use_gate=True), TTTLinear(256, 4, 16, use_gate=True)
    shapes = {name: tuple(t.shape) for name, t in mlp.state_dict().items()}
    expected = {name: tuple(t.shape) for name, t in linear.state_dict().items()}
    expected.update(W1=(4, 64, 256), b1=(4, 1, 256), W2=(4, 256, 64), b2=(4, 1, 64))
    assert shapes == expected
    for weight in (mlp.W1, mlp.W2):
        assert abs(weight.std().item() - 0.02) < 2e-3
    assert torch.count_nonzero(mlp.b1) == 0 and torch.count_nonzero(mlp.b2) == 0
    TTTMLP(256, 4, 16, use_gate=True).load_state_dict(
        {k: torch.randn_like(t) for k, t in mlp.state_dict().items()})


def test_official_initialisation():
    torch.manual_seed(0)
    layer = TTTLinear(256, 4, 16)
    assert abs(layer.W1.std().item() - 0.02) < 2e-3
    assert abs(layer.learnable_ttt_lr_weight.std().item() - 0.02) < 4e-3
    for zero in (layer.b1, layer.learnable_ttt_lr_bias, layer.learnable_token_idx,
                 layer.ttt_norm_bias):
        assert torch.count_nonzero(zero) == 0
    assert torch.equal(layer.ttt_norm_weight, torch.ones(4, 64))


def test_backend_argument_reaches_the_operator():
    layer = _case()
    x = torch.randn(1, 5, 16, dtype=torch.float64)
    layer.backend = "reference"
    layer(x)
    layer.backend = "no-such-backend"
    with pytest.raises(ValueError, match="no-such-backend"):
        layer(x)
    with ttt.set_backend("reference"):
        layer.backend = None
        layer(x)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(width=30, num_heads=4), ValueError, "num_heads"),
    (dict(width=12, num_heads=4), ValueError, "even"),
    (dict(width=16, num_heads=2, mini_batch_size=0), ValueError, "mini_batch_size"),
    (dict(width=16, num_heads=2.0), TypeError, "num_heads"),
    (dict(width=16, num_heads=2, rope_theta=-1.0), ValueError, "rope_theta"),
    (dict(width=16, num_heads=2, ttt_base_lr=0.0), ValueError, "ttt_base_lr"),
    (dict(width=16, num_heads=2, backend=3), TypeError, "backend"),
])
def test_bad_constructor_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        TTTLinear(**kwargs)


def test_bad_forward_arguments():
    layer = TTTLinear(16, 2, 4)
    with pytest.raises(TypeError, match="x"):
        layer([[0.0] * 16])
    with pytest.raises(ValueError, match=r"x: expected shape \[B, T >= 1, width = 16\]"):
        layer(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match="x"):
        layer(torch.randn(2, 0, 16))
    with pytest.raises(ValueError, match="cu_seqlens"):
        layer(torch.randn(2, 5, 16), cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(TypeError, match="cu_seqlens"):
        layer(torch.randn(1, 5, 16), cu_seqlens=[0, 5])
    with pytest.raises(TypeError, match="cache"):
        layer(torch.randn(1, 5, 16), cache={})


def test_bfloat16_autocast_stays_close_to_float32():
    """Under CPU autocast the projections run in bfloat16 (unit roundoff 2^-8 = 3.9e-3) and
    the inner states stay float32; the output is within a few bfloat16 roundings."""
    torch.manual_seed(0)
    layer = _randomized(TTTLinear(32, 4, 4, use_gate=True), seed=5)
    x = torch.randn(2, 11, 32)
    expected = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    assert got.dtype == torch.bfloat16
    assert _rel(got.float(), expected) < 2e-2
    got.float().square().sum().backward()
    assert layer.W1.grad.dtype == torch.float32 and torch.isfinite(layer.W1.grad).all()


def test_compiles_as_one_graph():
    """torch.compile(fullgraph=True) captures the whole layer, the operator included, and
    gives the eager outputs and gradients (aot_eager: dynamo and AOT autograd, no codegen)."""
    layer = _randomized(TTTLinear(16, 2, 4, use_gate=True), seed=9)
    x = torch.randn(2, 11, 16, requires_grad=True)
    probe = torch.randn(2, 11, 16)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got, expected = compiled(x), layer(x)
    torch.testing.assert_close(got, expected)
    params = [x, *layer.parameters()]
    for g_got, g_want in zip(_grads_of(got, probe, params), _grads_of(expected, probe, params)):
        torch.testing.assert_close(g_got, g_want)
