"""Built-in subjects; importing this package registers them all."""
from ep_harness.subjects.collective import (  # noqa: F401
    all_gather_fold,
    all_reduce_slice,
    custom_all_reduce,
    all_to_all_fold,
    reduce_scatter_native,
    reduce_scatterv_native,
    tree_reduce,
)
from ep_harness.subjects.gemm import deepgemm, fixed_order_mm, torch_bmm, torch_grouped_mm, torch_mm  # noqa: F401
from ep_harness.subjects.gemm import batch_invariant_ops, triton_bi_matmul  # noqa: F401
from ep_harness.subjects.quant import deepgemm_fp8, torch_fp8  # noqa: F401
from ep_harness.subjects.dispatch import deepep, torch_a2a  # noqa: F401
from ep_harness.subjects.moe import composed  # noqa: F401
from ep_harness.subjects.model import composed as model_composed  # noqa: F401
