"""One optimizer step captured as a CUDA graph and replayed: no host work per kernel.

On an H100 the host's side (Python, dispatch, one launch per kernel) paced the training step of
every backend (issue 17: our kernels' 13.9 ms of GPU time a base/CNN-DM step in 70-80 ms of wall
time). A CUDA graph records the step's kernels once and replays them with one launch. What a
captured step needs (torch.cuda.graph's documentation, "whole network capture"):
- fixed shapes and fixed input tensors: the caller copies each batch into the tensors the graph
  was captured with (here: the bench's one batch);
- nothing read on the host inside (`Trainer.train_step` reads nothing, tests/test_trainer.py);
- random draws from torch's CUDA generator, which advances per replay: torch's dropout, and our
  Triton ops' Philox state, drawn on the device (`kernels/_common.py`);
- AdamW with `capturable=True` (its step count on the device), autocast with
  `cache_enabled=False`, gradients created inside the capture (set to None before it) so they
  live in the graph's memory pool; each replay rewrites them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .. import graphs


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
