"""The run's statement of what the TP reductions under test went through, with the evidence
NCCL logged (environment.json's `tp_reduction`)."""
from __future__ import annotations

from pathlib import Path

from ep_harness.nccl.log import parse


def tp_reduction_statement(run_dir: Path, backend: str) -> dict:
    """What the TP reductions under test went through, with the evidence: torch.distributed on
    the backend, no engine custom all-reduce, no symmetric-memory all-reduce."""
    symmetric = []
    if backend == "nccl":
        for log in sorted(run_dir.glob("jobs/*/nccl-rank0-*.log")):
            symmetric += [c.describe() for c in parse(log.read_text(errors="replace")).calls if c.symmetric]
    return {
        "via": f"torch.distributed on {backend}",
        "engine_custom_all_reduce": "off: no engine is loaded; the custom_all_reduce subject is a control, not a TP path",
        "symmetric_memory_all_reduce": (f"ON: NCCL ran symmetric kernels ({', '.join(symmetric[:3])})" if symmetric else
                                        "off: TORCH_SYMM_MEM_DISABLE_MULTICAST=1" +
                                        ("; NCCL_WIN_ENABLE=0, NCCL_NVLS_ENABLE=0; NCCL logged no [Symmetric] "
                                         "kernel" if backend == "nccl" else "")),
    }
