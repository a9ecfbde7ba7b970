"""Error bounds against the float64 reference, in one place.

GEMM, per output element (the classic dot-product bound plus the output rounding):

    |D - D64| <= u_out * |D64| + gamma(K, u_acc) * sum_k |a_k * b_k|,  gamma(K, u) = K*u / (1 - K*u)

so the allowed error grows linearly with K. `u_acc` is the accumulator's unit roundoff with
a factor of 2 of slack for tensor-core accumulation that does not round to nearest.

| operands      | output | u_out | u_acc | why u_acc                                                 |
|---------------|--------|-------|-------|-----------------------------------------------------------|
| bfloat16      | bf16   | 2^-8  | 2^-23 | float32 accumulation                                      |
| float32       | fp32   | 2^-24 | 2^-23 | float32 accumulation (TF32 off)                           |
| float8_e4m3fn | bf16   | 2^-8  | 2^-13 | Hopper FP8 MMA keeps ~14 accumulator bits between the     |
|               |        |       |       | 128-K promotions into float32 (DeepSeek-V3 report)        |

MoE layer (bf16 activations; roundings at the TP reduce, gate-up, silu*up, down and combine):

    |out - out64| <= u_out * |out64| + factor * u_out * sum_j w_j * (|silu(g_j) * u_j| @ |W_down_j|^T)

with u_out = 2^-8 and factor = 8: a coarse bound at the down projection's scale, for every
token. A router flip changes the function, not its rounding: a flipped token is admitted only
where the swapped experts' float64 logits lie within the rounding margin of the router's
inputs (families/moe_layer.logit_margin), and is then held to the float64 layer routed to
the experts it chose; a flip outside the margin is a failure.

Model (harness/families/model.py; bf16 activations rounded at every stage of every layer,
bf16 logits, float32 log_softmax), per vocabulary entry v of a scored position:

    B_v = u_out * |logit64_v| + factor * u_out * (|x64| @ |W_lm|^T)_v
    |lp_v - lp64_v| <= B_v + max_u B_u

x64 is the reference's final normed hidden state: the second term is the LM head's
product at the scale it works at (as the MoE layer's bound), with factor = per_stage *
(2 * layers + 1) for the relative error x carries from the residual stream's roundings (two
residual adds per layer, their stages, the final norm), per_stage = 1; logsumexp is
1-Lipschitz in the max norm, hence + max_u B_u. A coarse first-order bound, with its teeth
measured: the default CPU model (4 layers) reaches about 0.05 of it (0.047 on 4 ranks);
the same model without one layer's shared expert is 2x over it, so it tells a model that
computes something from noise. Counted against a reference that follows the run's own
router choices and tokens (teacher forcing: a flip changes the function, not its rounding). A
choice that differs from the float64 router's own is admitted only where the two experts'
float64 logits lie within factor * u_out * (|x64| @ |W_router|^T) (+ 8 float32 ulp) of each
other, the same relative error carried to the router's input; any other flip is a failure.

Collectives: a sum of W contributions rounded after every hop obeys
|s - s64| <= gamma(W-1, u) * sum_r |x_r| with u the wire dtype's unit roundoff.
"""
from __future__ import annotations

GEMM = {
    "bfloat16": {"u_out": 2.0 ** -8, "u_acc": 2.0 ** -23},
    "float32": {"u_out": 2.0 ** -24, "u_acc": 2.0 ** -23},
    "float8_e4m3fn": {"u_out": 2.0 ** -8, "u_acc": 2.0 ** -13},
}


MOE = {"u_out": 2.0 ** -8, "factor": 8.0,
       "rule": "|err| <= u_out*|out64| + factor*u_out*sum_j w_j (|act_j| @ |W_down_j|^T)"}


MODEL = {"u_out": 2.0 ** -8, "per_stage": 1.0,
         "rule": "|err_v| <= B_v + max_u B_u, B_v = u_out*|logit64_v| + factor*u_out*(|x64| @ |W_lm|^T)_v, "
                 "factor = per_stage*(2*layers+1)"}


def model_factor(layers: int) -> float:
    return MODEL["per_stage"] * (2 * layers + 1)


def gamma(n: int, u: float) -> float:
    if n * u >= 1:
        raise ValueError(f"gamma({n}, {u}) is undefined: n*u >= 1")
    return n * u / (1 - n * u)


def gemm_bound(dtype: str, k: int) -> dict:
    t = GEMM[dtype]
    return {"rule": "|err| <= u_out*|D64| + gamma(K, u_acc)*sum|a*b|", "u_out": t["u_out"], "u_acc": t["u_acc"],
            "K": k, "gamma": gamma(k, t["u_acc"])}
