"""Eager vs CUDA-graph execution of one call with static buffers."""
from __future__ import annotations

from typing import Callable

import torch


def replay_in_graph(fn: Callable[[torch.Tensor, torch.Tensor], None], out: torch.Tensor,
                    inp: torch.Tensor) -> None:
    """Capture fn(out, inp) in a CUDA graph, replay it on a decoy input and then on the real one.

    The decoy (the input's rows rolled by one) makes stale state visible: if the graph kept
    anything from the decoy replay (a cached pointer, an unflushed buffer), the second
    replay's bits change.
    """
    real = inp.clone()
    raw = inp.view(torch.uint8) if inp.element_size() == 1 else inp  # roll has no fp8 kernel
    decoy = raw.roll(1, 0).view(inp.dtype)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up outside capture: lazy inits and allocator pools
            fn(out, inp)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(out, inp)
    inp.copy_(decoy)
    graph.replay()
    inp.copy_(real)
    graph.replay()
    torch.cuda.synchronize()
