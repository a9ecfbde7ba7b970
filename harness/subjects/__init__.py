"""Built-in subjects; importing this package registers them all."""
from harness.subjects.collective import (  # noqa: F401
    all_gather_fold,
    all_reduce_slice,
    all_to_all_fold,
    reduce_scatter_native,
    reduce_scatterv_native,
)
