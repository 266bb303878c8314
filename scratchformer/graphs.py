"""CUDA graph capture of a callable: what decoding (`model/decoding.py`, one decoder step) and the
training step (`training/cuda_graph.py`, one optimizer step; the trainer's `--cuda-graphs`, one
graph per batch shape) replay instead of launching each kernel from Python.

What a captured callable needs (torch.cuda.graph's documentation, "whole network capture"):
fixed shapes and fixed input tensors (the caller copies new inputs into the ones captured with),
no host read inside (no `.item()`, no value checks), random draws from torch's CUDA generator
(which advances per replay), and memory it allocates inside living in the graph's pool (rewritten
by each replay).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def _autocast() -> torch.autocast:
    """The enclosing autocast's state with its cache of cast weights off (each cast is captured,
    none outlives the graph)."""
    return torch.autocast(device_type="cuda", enabled=torch.is_autocast_enabled("cuda"),
                          dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def warm(fn: Callable[[], object], stream: torch.cuda.Stream) -> object:
    """fn() run on `stream`, a side stream (what a capture on it needs first: Triton compiles and
    autotuning, cuBLAS workspaces, an optimizer's state), ordered after the current stream's work
    and before its next: -> what fn returned."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), _autocast():
        out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return out


def record(fn: Callable[[], object], stream: torch.cuda.Stream | None = None,
           pool: tuple | None = None) -> tuple[object, Callable[[], None]]:
    """fn() captured as a CUDA graph on `stream` (after `warm`) -> (what the captured call
    returned, the graph's replay). The capture runs nothing. Graphs given one `pool`
    (`torch.cuda.graph_pool_handle()`) share their memory: safe when what one replay leaves
    behind is only its outputs, which the caller keeps referenced. The capture tolerates other
    threads' CUDA calls (`capture_error_mode="thread_local"`: a DataLoader's pin-memory thread
    allocating pinned memory meanwhile). Raises (from CUDA) on anything a graph cannot hold,
    such as a host sync inside; the CUDA generator stays usable then (`release_generator`), and the
    caller's current stream is its own again: torch.cuda.graph's exit ends the capture before it
    leaves the capture's stream, so a capture that fails at its end (torch 2.11) left the capture's
    side stream current for everything after it (the tenth window: every later benchmark case ran
    on it)."""
    graph = torch.cuda.CUDAGraph()
    caller = torch.cuda.current_stream()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"), _autocast():
            out = fn()
    except BaseException:
        release_generator()
        torch.cuda.set_stream(caller)
        raise
    return out, graph.replay


def release_generator() -> None:
    """After a failed capture: torch's CUDA generator stays marked as capturing (torch 2.11 takes
    the mark off only when a capture ends well), and every later draw from it on the device raises
    "Offset increment outside graph capture encountered unexpectedly": a run that goes on launched
    (decoding's fallback) would fail at its next dropout or `torch.randn` (2026-11-26, H100: one
    failed capture in a benchmark failed the next 20 cases so). A clone of the generator's state,
    put in its place, holds the same seed and no mark. Graphs captured before keep the old state
    and advance it from the same offset at each replay, so the new one starts 2^50 further on:
    the two never draw the same numbers."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    offset = gen.get_offset()
    gen.graphsafe_set_state(gen.clone_state())
    gen.set_offset(offset + (1 << 50))


def capture(fn: Callable[[], object], warmup: int = 1) -> tuple[object, Callable[[], None]]:
    """fn() captured as a CUDA graph after `warmup` calls on a side stream -> (what the captured
    call returned, the graph's replay). See `warm` and `record`."""
    side = torch.cuda.Stream()
    for _ in range(warmup):
        warm(fn, side)
    return record(fn, side)
