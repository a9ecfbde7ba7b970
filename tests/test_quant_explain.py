"""FP8 quantization's reference: which differences `explain` may put down to double rounding
(issue 32). Planted quantizers that are wrong in ways a float32 intermediate cannot be."""
import torch

from ep_harness import inputs as gen
from ep_harness.families import quant
from ep_harness.families.quant import QuantParams
from ep_harness.reference import quant as ref
from ep_harness.subjects.quant.torch_fp8 import scales


def ties_toward_zero(v: torch.Tensor) -> torch.Tensor:
    """e4m3 of float64 `v`, ties rounded toward zero. e4m3 midpoints are float32 numbers;
    any other float32 is at least 2^-24 (relative) away from one, so shrinking by 2^-40
    moves only the ties."""
    return ref.round_to_e4m3(v.double() * (1 - 2.0 ** -40))


def quantize_ties_toward_zero(x: torch.Tensor, ue8m0: bool):
    """torch_fp8_quant's float32 quotient, its ties rounded toward zero instead of to even."""
    s = scales(x, ue8m0)
    quotient = (x.float().view(x.shape[0], -1, 128) / s.unsqueeze(2)).view(x.shape)
    return ties_toward_zero(quotient), s


def check(p: QuantParams, quantizer):
    x = gen.values((p.rows, p.cols), gen.dtype_of(p.dtype), p.seed, "quant-input", data=p.data)
    q, s = quantizer(x, p.ue8m0)
    return quant._measure_reference(p, q, s, gen.dtype_of(p.dtype), x), x


def test_the_real_double_rounding_is_still_explained():
    """The positive side: torch_fp8_quant (float32 quotient, then the cast) differs from the
    exact reference only by double rounding, and every difference is explained."""
    from ep_harness.subjects.quant.torch_fp8 import TorchFp8Quant

    m, _ = check(QuantParams(ue8m0=False), TorchFp8Quant().quantize)
    causes = m.detail["explained"]
    assert m.mismatched > 0 and m.extra_failure is None
    assert causes["values_by_double_rounding"] == causes["values_differ"] == m.mismatched


def test_ties_toward_zero_at_float32_ties_is_not_double_rounding():
    m, _ = check(QuantParams(ue8m0=False), quantize_ties_toward_zero)
    causes = m.detail["explained"]
    assert causes["values_differ"] > causes["values_by_double_rounding"] + causes["values_by_scale"]
    assert m.extra_failure and "no known cause" in m.extra_failure


def test_with_ue8m0_scales_nothing_is_double_rounding():
    """Power-of-two scales: x / scale is exact, so the bf16 inputs' exact ties are ties of the
    cast itself; a quantizer that rounds them toward zero is wrong, not double-rounded."""
    m, _ = check(QuantParams(ue8m0=True), quantize_ties_toward_zero)
    causes = m.detail["explained"]
    assert causes["values_differ"] > 0 and causes["values_by_double_rounding"] == 0
    assert m.extra_failure and f"{causes['values_differ']:,} quantized values" in m.extra_failure


def test_signed_zero_differences_are_named():
    """A quantizer that writes +0.0 where the exact e4m3 is -0.0 (tiny negative values in a
    group with a large one): the record's bit_only counts them and the reason names them."""
    p = QuantParams(rows=2, cols=128, ue8m0=True)
    x = torch.full((2, 128), -1e-6, dtype=torch.bfloat16)
    x[:, 0] = 100.0
    q, s = ref.quantize_per_token_group(x, ue8m0=True)
    assert (q.view(torch.uint8) == 0x80).sum() == 2 * 127  # -0.0 in the exact result
    wrong = torch.where(q.float() == 0, torch.zeros_like(q.float()), q.float()).to(torch.float8_e4m3fn)
    m = quant._measure_reference(p, wrong, s, torch.bfloat16, x)
    assert m.mismatched == 254 and m.bit_only == {"signed_zero": 254}
    assert m.detail["explained"]["values_signed_zero"] == 254
    assert "254 of them signed zeros: +0.0 against -0.0" in m.extra_failure
