"""Training steps captured as CUDA graphs and replayed: no host work per kernel.

On an H100 the host's side (Python, dispatch, one launch per kernel) paced the training step of
every backend (issue 17: our kernels' 13.9 ms of GPU time a base/CNN-DM step in 70-80 ms of wall
time; the `small` model's Multi30k step 50 ms, its GPU work not profiled). A CUDA graph records the
step's kernels once and replays them with one launch. What a captured step needs (torch.cuda.graph's
documentation, "whole network capture"):
- fixed shapes and fixed input tensors: the caller copies each batch into the tensors the graph
  was captured with, one graph per batch shape (`ShapeGraphs`, the trainer's `--cuda-graphs`);
- nothing read on the host inside (`Trainer.train_step` reads nothing, tests/test_trainer.py),
  and nothing that changes between steps baked in: the step's token count and the learning rate
  are tensors on the device, refilled before each replay;
- random draws from torch's CUDA generator, which advances per replay: torch's dropout, and our
  Triton ops' Philox state, drawn on the device (`kernels/_common.py`);
- AdamW with `capturable=True` (its step count on the device), autocast with
  `cache_enabled=False`, gradients created inside the capture (set to None before it) so they
  live in the graph's memory pool; each replay rewrites them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import graphs
from ..data import Batch

# (loss sum, NLL sum, gradient norm): 0-dim fp32 tensors on the device
Figures = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def capture_step(update: Callable[[], object], optimizer: torch.optim.Optimizer, warmup: int = 3) -> Callable[[], None]:
    """The replay of a CUDA graph of one `update()` (forward, backward, clipping, optimizer step;
    no zero_grad): `warmup` updates first on a side stream (compiles, autotuning, cuBLAS
    workspaces, the optimizer's state), the gradients set to None, then one update captured.
    What it returns is dropped: to read a figure (the loss), have `update` write it into a tensor
    made before the capture, which each replay rewrites. Raises (from CUDA) on anything a graph
    cannot hold, such as a host sync inside."""
    if any(g.get("capturable") is False for g in optimizer.param_groups):  # Adam(W)s have the flag; SGD needs none
        raise ValueError("capture_step: the optimizer must be created with capturable=True (its step count "
                         "on the device), or each replay would reuse the captured learning-rate factors")

    def step():
        optimizer.zero_grad(set_to_none=True)  # inside the capture: the gradients live in its pool
        update()

    return graphs.capture(step, warmup)[1]


def portable(optimizer_state: dict, scheduler_state: dict) -> None:
    """A checkpoint's optimizer and schedule states as any run resumes them, in place: the
    learning rates (which `make_capturable` made device tensors) plain numbers, capturable off."""
    for group in optimizer_state["param_groups"]:
        group.update(lr=float(group["lr"]), **({"capturable": False} if "capturable" in group else {}))
    if "_last_lr" in scheduler_state:
        scheduler_state["_last_lr"] = [float(lr) for lr in scheduler_state["_last_lr"]]


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """An optimizer a capture can hold, in place: `capturable` set (AdamW keeps its step count on
    the device: fused AdamW already does) and each group's learning rate a 0-dim tensor on
    `device`, which the schedulers refill in place (torch's LRScheduler and ReduceLROnPlateau do)
    and the captured step reads. Call it after loading a checkpoint's optimizer state (which
    brings back plain floats) and before the first capture."""
    for group in optimizer.param_groups:
        if "capturable" in group:
            group["capturable"] = True
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=device)


@dataclass
class _Graph:
    group: list[Batch]  # the fixed inputs, refilled before each replay
    ntok: torch.Tensor  # the group's target tokens (the loss's divisor), refilled too
    figures: torch.Tensor  # (3,): what each replay writes
    replay: Callable[[], None]


class ShapeGraphs:
    """Training steps replayed as CUDA graphs, one graph per batch shape, all in one memory pool.

    `update(group, ntok, graphed)` is one optimizer step without zero_grad (the trainer's: forward,
    backward, clipping, AdamW) over batches on the device, dividing the loss by `ntok` (an int, or a
    0-dim tensor), under autocast without its cache when `graphed`; it returns the step's figures
    and reads nothing on the host. Calling this object with a group of batches (on the host,
    pinned) steps as `update` would: the first group of a shape runs `update` on a side stream (a
    real step, and the warm-up a capture needs: Triton compiles this shape's kernels there); the
    second is captured (nothing runs) and replayed; every later one is copied into that graph's
    inputs and replayed. A shape seen once costs no capture. Token-budget batches take many
    shapes, but the common ones dominate: Multi30k's 8,192-token batches take 476 shapes in 300
    epochs (18.5k steps; the sampler's batches, our 8,000-token BPE); if a capture costs 1.5
    launched steps and a replay 0.1 (assumed, not measured), capturing at the second sighting
    averages 0.14 launched steps a step (at the third or fourth, no better).

    The graphs share one pool: what a replay leaves behind is its figures (kept referenced here,
    so no later capture takes their memory; the caller gets a copy) and the gradients, which the
    next step sets to None (`zero_grad`) and the next replay of any graph rewrites before reading."""

    def __init__(self, update: Callable[[list[Batch], int | torch.Tensor, bool], Figures],
                 optimizer: torch.optim.Optimizer, device: torch.device):
        make_capturable(optimizer, device)
        self.update, self.optimizer, self.device = update, optimizer, device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: set[tuple] = set()  # shapes stepped: each one's first step was launched
        self.replayed = 0

    def __call__(self, group: list[Batch], ntok: int) -> Figures:
        key = tuple(b.shape for b in group)
        graph = self.graphs.get(key)
        if graph is None and key not in self.seen:  # first of its shape: a launched step, on the capture stream
            self.seen.add(key)
            on_device = [b.to(self.device, non_blocking=True) for b in group]
            return graphs.warm(lambda: self.update(on_device, ntok, True), self.stream)
        if graph is None:
            graph = self.graphs[key] = self._capture([b.to(self.device) for b in group])
        else:
            for fixed, b in zip(graph.group, group):
                fixed.copy_(b, non_blocking=True)
        graph.ntok.fill_(ntok)
        graph.replay()
        self.replayed += 1
        return graph.figures.clone().unbind()  # the caller's: the next replay of this graph rewrites its own

    def _capture(self, group: list[Batch]) -> _Graph:
        ntok = torch.zeros((), dtype=torch.float32, device=self.device)
        self.optimizer.zero_grad(set_to_none=True)  # the captured backward creates them in the pool

        def step() -> torch.Tensor:
            return torch.stack(self.update(group, ntok, True))

        figures, replay = graphs.record(step, self.stream, self.pool)
        return _Graph(group, ntok, figures, replay)

    def describe(self) -> str:
        return (f"cuda graphs: {len(self.graphs)} batch shapes captured ({len(self.seen)} seen), "
                f"{self.replayed} steps replayed, {len(self.seen)} launched")
