"""CUDA graph capture of a callable: what decoding (`model/decoding.py`, one decoder step) and the
training step (`training/cuda_graph.py`, one optimizer step) replay instead of launching each
kernel from Python.

What a captured callable needs (torch.cuda.graph's documentation, "whole network capture"):
fixed shapes and fixed input tensors (the caller copies new inputs into the ones captured with),
no host read inside (no `.item()`, no value checks), random draws from torch's CUDA generator
(which advances per replay), and memory it allocates inside living in the graph's pool (rewritten
by each replay).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(fn: Callable[[], object], warmup: int = 1) -> tuple[object, Callable[[], None]]:
    """fn() captured as a CUDA graph -> (what the captured call returned, the graph's replay).

    The `warmup` calls first run on a side stream (Triton compiles and autotuning, cuBLAS
    workspaces, an optimizer's state); the capture itself runs nothing. Under autocast, its cache
    of cast weights is off for both (each cast is captured, none outlives the graph). The capture
    tolerates other threads' CUDA calls (`capture_error_mode="thread_local"`: a DataLoader's
    pin-memory thread allocating pinned memory meanwhile). Raises (from CUDA) on anything a graph
    cannot hold, such as a host sync inside."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    amp = dict(device_type="cuda", enabled=torch.is_autocast_enabled("cuda"), dtype=torch.get_autocast_dtype("cuda"),
               cache_enabled=False)
    with torch.cuda.stream(side), torch.autocast(**amp):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"), torch.autocast(**amp):
        out = fn()
    return out, graph.replay
