"""pope.pope_cartesian's written-out backward (pope._Cartesian, issues 67 and 75): second derivatives and precision.

The references are PoPE's Cartesian form written out in plain float64 autograd, scale * magnitude(x) [cos(phi),
sin(phi)] with phi = s theta_c + delta_c formed from each token's position (no rotation table, no angle addition),
whose first and second derivatives are autograd's own."""

import math

import pytest
import torch
import torch.nn.functional as F

from pope import pope_cartesian, pope_frequencies

MAGNITUDE = {"softplus": F.softplus, "relu": F.relu, "identity": lambda x: x}


def _positions(B, T, per_token, g):
    """Each token's position: 0..T-1 for every row, or (per_token) random positions below 64 per batch row."""
    if per_token:
        return torch.randint(0, 64, (B, T), generator=g)
    return torch.arange(T).expand(B, T)


def _rows(positions, d, per_token):
    """pope_cartesian's rows for `positions` (B, T), in float64 from the float32 frequencies: (T, 2d) shared by the
    batch, or (B, 1, T, 2d) per token (as pope_attention passes them with position_ids)."""
    phase = positions.double()[..., None] * pope_frequencies(d).double()
    rows = torch.cat((torch.cos(phase), torch.sin(phase)), dim=-1)
    return rows.unsqueeze(1) if per_token else rows[0]


def _formula(x, delta, positions, magnitude="softplus", scale=1.0):
    """The transform in plain float64 autograd: (B, H, T, 2d) scale * mu [cos(phi), sin(phi)]."""
    d = x.shape[-1]
    phase = positions.double()[:, None, :, None] * pope_frequencies(d).double()  # (B, 1, T, d)
    if delta is not None:
        phase = phase + delta.double()[None, :, None, :]
    mu = scale * MAGNITUDE[magnitude](x.double())
    return torch.cat((mu * torch.cos(phase), mu * torch.sin(phase)), dim=-1)


def _inputs(magnitude, per_token, seed=0, B=2, H=3, T=5, d=4):
    g = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(B, H, T, d, generator=g, dtype=torch.float64)
    if magnitude == "relu":  # away from the kink, where finite differences are not the derivative
        x = x.sign() * (x.abs() + 0.1)
    delta = -2 * math.pi * torch.rand(H, d, generator=g, dtype=torch.float64)
    positions = _positions(B, T, per_token, g)
    return x.requires_grad_(), delta.requires_grad_(), positions


@pytest.mark.parametrize("magnitude", ["softplus", "relu", "identity"])
@pytest.mark.parametrize("per_token", [False, True], ids=["table_rows", "position_ids_rows"])
def test_second_derivatives_through_the_transform_are_plain_autograds(magnitude, per_token):
    """Issue 75: with create_graph=True the backward's own derivatives are the transform's second derivatives, in x
    and delta: gradgradcheck passes (before: False, every second derivative through delta silently 0), and a
    Hessian-vector product in (x, delta) with the upstream gradient's derivative too equals plain autograd's on the
    formula, for each magnitude function, a scale, table rows and per-token rows."""
    x, delta, positions = _inputs(magnitude, per_token)
    rows = _rows(positions, x.shape[-1], per_token)

    def f(x, delta):
        return pope_cartesian(x, rows, delta, magnitude, 0.7)

    assert torch.autograd.gradgradcheck(f, (x, delta))
    g = torch.Generator().manual_seed(1)
    v = torch.randn(f(x, delta).shape, generator=g, dtype=torch.float64).requires_grad_()
    wx, wd = torch.randn(x.shape, generator=g, dtype=torch.float64), torch.randn(delta.shape, generator=g).double()
    got, want = [], []
    for out, into in ((f(x, delta), got), (_formula(x, delta, positions, magnitude, 0.7), want)):
        gx, gd = torch.autograd.grad(out, (x, delta), v, create_graph=True)
        into += torch.autograd.grad(gd.sum(), delta, retain_graph=True)  # the grad(grad(out, delta, v).sum())
        into += torch.autograd.grad((gx * wx).sum() + (gd * wd).sum(), (x, delta, v), allow_unused=True)
    for a, b in zip(got, want):
        assert a is not None
        torch.testing.assert_close(a, torch.zeros_like(a) if b is None else b, atol=1e-12, rtol=1e-10)


def test_a_second_derivative_in_delta_alone_or_x_alone_is_plain_autograds():
    """Delta fine-tuning (x a constant) and x alone (delta a constant): the Hessian of a loss of the transform in the
    one trainable input is plain autograd's (delta's Hessian was None before)."""
    x, delta, positions = _inputs("softplus", False, seed=2)
    rows = _rows(positions, x.shape[-1], False)
    for wrt in ("delta", "x"):
        fixed = {"x": x.detach(), "delta": delta.detach()}
        arg = {"x": x, "delta": delta}[wrt]

        def loss(t, fn, fixed=fixed, wrt=wrt):
            args = {**fixed, wrt: t}
            return fn(args["x"], args["delta"]).sin().sum()

        got = torch.autograd.functional.hessian(lambda t: loss(t, lambda a, b: pope_cartesian(a, rows, b)), arg)
        want = torch.autograd.functional.hessian(lambda t: loss(t, lambda a, b: _formula(a, b, positions)), arg)
        assert got.abs().max() > 0.1
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("under", ["bf16_inputs", "bf16_autocast"])
def test_the_backward_computes_in_float32_for_bf16_inputs(under):
    """Issue 75, pc-bwd-low-precision: the backward (dx and d(delta)) is computed in float32 from 16-bit x and a 16-bit
    upstream gradient, as the forward is. Against plain float64 autograd on the same bf16 values: d(delta), a float32
    sum over B * T = 1024 terms, is within 1e-5 (computed in bf16: 1e-3 and more); dx, rounded once to bf16, is the
    reference rounded to bf16 in all but a few elements (computed in bf16: a third of them differ). Under bf16
    autocast (forward and backward inside it) as with bf16 inputs alone."""
    g = torch.Generator().manual_seed(5)
    B, H, T, d = 2, 2, 512, 32
    x = (2 * torch.randn(B, H, T, d, generator=g)).bfloat16().requires_grad_()
    delta = (-2 * math.pi * torch.rand(H, d, generator=g)).requires_grad_()
    up = torch.randn(B, H, T, 2 * d, generator=g).bfloat16()
    positions = torch.arange(T).expand(B, T)
    rows = _rows(positions, d, False).float()  # the model's float32 table rows
    context = torch.autocast("cpu", dtype=torch.bfloat16, enabled=under == "bf16_autocast")
    with context:
        out = pope_cartesian(x, rows, delta)
        assert out.dtype == torch.bfloat16
        dx, dd = torch.autograd.grad(out, (x, delta), up)
    x64, d64 = x.detach().double().requires_grad_(), delta.detach().double().requires_grad_()
    want_dx, want_dd = torch.autograd.grad(_formula(x64, d64, positions), (x64, d64), up.double())
    assert dx.dtype == torch.bfloat16 and dd.dtype == torch.float32
    err = ((dd.double() - want_dd).abs().max() / want_dd.abs().max()).item()
    assert err < 1e-5, err
    differ = (dx != want_dx.to(torch.bfloat16)).double().mean().item()
    assert differ < 0.01, differ
