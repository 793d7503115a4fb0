"""Weight formats and the reference's activation round trips against straightforward references."""

from __future__ import annotations

import itertools

import pytest
import torch

from model import quant

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def fp4_nearest_even_ref(x: float) -> float:
    """Nearest e2m1 magnitude, ties to the even code, sign kept."""
    a = min(abs(x), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c % 2))
    return E2M1[best] * (-1 if x < 0 else 1)


def test_fp4_codes_round_to_nearest_even():
    xs = [i / 8 for i in range(-56, 57)]
    got = quant.FP4_VALUES[quant.fp4_codes(torch.tensor(xs))].tolist()
    assert got == [fp4_nearest_even_ref(x) for x in xs]


@pytest.mark.parametrize("shape", [(5, 123), (128, 256), (130, 129)])
def test_fp8_weight_round_trip_error_is_bounded(shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q, s = quant.quantize_fp8(w, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
    assert s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    back = quant.dequantize_fp8(q, s, (128, 128))
    assert ((back - w).abs() <= w.abs() * 2 ** -3 + 2 ** -9).all()  # e4m3: 3 mantissa bits
    assert torch.all(torch.log2(s.float()) == torch.log2(s.float()).round())  # powers of two


def test_fp4_pack_layout_low_nibble_first():
    w = torch.tensor([[0.5, 6.0] + [0.0] * 30])
    q, s = quant.quantize_fp4(w)
    assert s.float().item() == 1.0
    assert (q.view(torch.uint8)[0, 0].item() & 0xF) == 1 and (q.view(torch.uint8)[0, 0].item() >> 4) == 7
    assert torch.equal(quant.dequantize_fp4(q, s), w)


def test_fp4_round_trip_is_exact_on_representable_values():
    vals = torch.tensor(list(itertools.product(E2M1, repeat=2))).flatten()[:64] * 4
    w = torch.stack([vals, -vals])
    assert torch.equal(quant.dequantize_fp4(*quant.quantize_fp4(w)), w)


def test_activation_round_trips_match_reference():
    x = torch.randn(3, 7, 100, generator=torch.Generator().manual_seed(1)) * 3
    y = quant.fp8_roundtrip(x, 64)
    for blk in (slice(0, 64), slice(64, 100)):
        part = x[..., blk]
        s = torch.exp2(torch.ceil(torch.log2(part.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448)))
        torch.testing.assert_close(y[..., blk], (part / s).to(torch.float8_e4m3fn).float() * s, atol=0, rtol=0)
    z = quant.fp4_roundtrip(x[..., :64])
    part = x[..., 32:64]
    s = torch.exp2(torch.ceil(torch.log2(part.abs().amax(-1, keepdim=True) / 6)))
    ref = torch.tensor([fp4_nearest_even_ref(v) for v in (part / s).flatten().tolist()]).view_as(part) * s
    torch.testing.assert_close(z[..., 32:64], ref, atol=0, rtol=0)


def test_hadamard_is_orthonormal_sylvester():
    h2 = torch.tensor([[1.0, 1.0], [1.0, -1.0]])
    m = h2
    for _ in range(4):
        m = torch.kron(m, h2)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(quant.hadamard(x), x @ m.T / 32 ** 0.5)
    with pytest.raises(ValueError, match="power-of-two"):
        quant.hadamard(torch.zeros(3, 12))
