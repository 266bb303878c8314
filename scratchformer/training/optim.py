"""The optimisation recipe: label-smoothed loss, AdamW, and learning-rate schedules with warmup."""

from __future__ import annotations

import math

import torch

from ..evaluation.evaluate import loss_terms, seq2seq_loss
from ..model import PAD_ID
from ..reference import cross_entropy_ref, nll_loss_ref

# Metrics where a larger value is better (the rest, e.g. loss and ppl, are minimised).
HIGHER_IS_BETTER = {"bleu", "chrf", "exact_match", "accuracy", "rouge1", "rouge2", "rougeL", "rougeLsum"}


def is_better(metric: str, new: float, best: float | None) -> bool:
    """Whether `new` improves on `best` (None: nothing yet). A NaN (a diverged validation) is never
    better, and anything else is better than a NaN best: one NaN must not hold best.pt for good."""
    if math.isnan(new):
        return False
    if best is None or math.isnan(best):
        return True
    return new > best if metric in HIGHER_IS_BETTER else new < best


def label_smoothed_loss(logits: torch.Tensor, target: torch.Tensor, epsilon: float, pad_id: int = PAD_ID):
    """Summed label-smoothed cross-entropy and summed NLL of logits (N, V) against target (N,),
    PAD targets left out: `reference.cross_entropy_ref`, the loss every backend's
    `linear_cross_entropy` computes from the generator's input. Returns (loss sum, NLL sum)."""
    return cross_entropy_ref(logits, target, epsilon, pad_id)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, epsilon: float):
    """Summed label-smoothed cross-entropy and summed NLL of a classifier: logits (B, C), labels
    (B,). Label 0 equals PAD_ID, so nothing is ignored here."""
    loss = torch.nn.functional.cross_entropy(logits.float(), labels, reduction="sum", label_smoothing=epsilon)
    nll = torch.nn.functional.cross_entropy(logits.float().detach(), labels, reduction="sum")
    return loss, nll


def extractive_loss(logits: torch.Tensor, labels: torch.Tensor, epsilon: float):
    """Summed binary cross-entropy of each sentence's logit against its oracle label, smoothed to
    1 - eps/2 and eps/2, and the summed unsmoothed BCE: logits and labels (B, S), label -1 a padded
    slot, ignored (zeroed, not indexed out: no host-device sync)."""
    x, y = logits.float(), labels.clamp(min=0).float()
    nll = torch.nn.functional.binary_cross_entropy_with_logits(x, y, reduction="none")
    loss = torch.nn.functional.binary_cross_entropy_with_logits(x, y * (1.0 - epsilon) + epsilon / 2,
                                                                reduction="none") if epsilon else nll
    keep = labels >= 0
    return torch.where(keep, loss, 0.0).sum(), torch.where(keep, nll, 0.0).sum()


def rdrop_loss(task: str, logits: torch.Tensor, target: torch.Tensor, epsilon: float, alpha: float,
               pad_id: int = PAD_ID):
    """R-Drop (Liang et al. 2021) over one batch run twice (`Batch.twice`: logits rows [0, N) and
    [N, 2N), each under its own dropout; the same targets): the paper's objective, the two copies'
    losses plus alpha times the mean of KL(p1 || p2) and KL(p2 || p1), halved so that it is summed
    over one copy's targets as `task_loss` is. Returns (loss sum, NLL sum), the NLL the copies' mean;
    a seq2seq target of PAD is left out, a class label never is."""
    lprobs = torch.log_softmax(logits.float(), dim=-1)
    if task == "classification":
        loss, nll = classification_loss(logits, target, epsilon)
    else:  # the log-probabilities the KL needs anyway: one log_softmax, one (2N, V) tensor kept for the backward
        loss, nll = nll_loss_ref(lprobs, target, epsilon, pad_id)
    lp, lq = lprobs.chunk(2)
    kl = ((lp.exp() - lq.exp()) * (lp - lq)).sum(-1)  # KL(p || q) + KL(q || p), per row
    if task != "classification":
        kl = torch.where(target.chunk(2)[0] != pad_id, kl, 0.0)
    return (loss + alpha * kl.sum() / 2) / 2, nll / 2


def batch_loss(model, batch, task: str, epsilon: float):
    """(loss sum, NLL sum) of one batch on the device. A seq2seq model returns its own loss (the
    backend's `linear_cross_entropy`: the generator and the loss fused, so the triton backend never
    holds the batch's whole logits); the other tasks score the logits `loss_terms` returns."""
    sums = seq2seq_loss(model, batch, epsilon)
    if sums is not None:
        return sums
    logits, target = loss_terms(model, batch)
    return task_loss(task)(logits, target, epsilon)


def task_loss(task: str):
    """The loss of a task's batches: fn(logits, target, epsilon) -> (loss sum, NLL sum)."""
    return {"classification": classification_loss, "extractive": extractive_loss}.get(task, label_smoothed_loss)


class InverseSqrt:
    """Linear warmup to the peak, then peak * sqrt(warmup / step): the Noam schedule of the paper
    (lr = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)) with the peak as a free parameter."""

    def __init__(self, warmup: int):
        self.warmup = max(1, warmup)

    def __call__(self, step: int) -> float:  # step: 0-based count of optimizer steps taken
        s = step + 1
        return min(s / self.warmup, math.sqrt(self.warmup / s))


class WarmupCosine:
    """Linear warmup, then cosine decay from the peak to min_ratio * peak at total steps."""

    def __init__(self, warmup: int, total: int, min_ratio: float = 0.0):
        self.warmup, self.total, self.min_ratio = max(1, warmup), max(1, total), min_ratio

    def __call__(self, step: int) -> float:
        s = step + 1
        if s <= self.warmup:
            return s / self.warmup
        t = min(1.0, (s - self.warmup) / max(1, self.total - self.warmup))
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * t))


class Constant:
    def __init__(self, warmup: int):
        self.warmup = max(1, warmup)

    def __call__(self, step: int) -> float:
        return min(1.0, (step + 1) / self.warmup)


class WarmupPlateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
    """ReduceLROnPlateau after a linear warmup to the peak lr (fairseq's reduce_lr_on_plateau):
    `step()` after each optimizer step ramps the lr, peak * (k + 1) / warmup at step k (0-based), as
    the other schedules do; `step(metric)` after each validation halves it once more
    than `patience` validations in a row bring no gain (a NaN brings none), counting none before the
    warmup ends. warmup 0: from the peak."""

    def __init__(self, optimizer, warmup: int, **kw):
        super().__init__(optimizer, **kw)
        self.warmup, self.updates = warmup, 0
        self.peaks = [float(group["lr"]) for group in optimizer.param_groups]
        self.ramp()

    def step(self, metrics=None) -> None:  # type: ignore[override]
        if metrics is None:  # an optimizer step
            self.updates += 1
            self.ramp()
        elif self.updates >= self.warmup:
            super().step(metrics)

    def ramp(self) -> None:
        """The warmup's lr for the next step (until it ends); a 0-dim lr tensor (--cuda-graphs) refilled in place."""
        if self.updates >= self.warmup:
            return
        for group, peak in zip(self.optimizer.param_groups, self.peaks):
            lr = peak * (self.updates + 1) / self.warmup
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]


def build_scheduler(optimizer, name: str, *, warmup: int, total: int, min_lr: float = 0.0, peak: float = 1.0,
                    metric_mode: str = "min", patience: int = 2):
    """LambdaLR (inverse_sqrt, cosine, constant) or WarmupPlateau (plateau), stepped per optimizer
    step; plateau is stepped per validation with the best metric too."""
    if name == "plateau":
        return WarmupPlateau(optimizer, warmup, mode=metric_mode, factor=0.5, patience=patience)
    fn = {"inverse_sqrt": lambda: InverseSqrt(warmup), "constant": lambda: Constant(warmup),
          "cosine": lambda: WarmupCosine(warmup, total, min_lr / peak if peak else 0.0)}[name]()
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def lr_taken(scheduler) -> float:
    """The learning rate the last optimizer step took: a schedule has moved the optimizer's to the
    next step's (but plateau's after its warmup: it moves the lr at validations, after the row is logged).
    0 before any update was made (a first step whose fp16 gradients overflowed: the scaler skipped it)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        made = scheduler.last_epoch  # updates made
        return scheduler.base_lrs[0] * scheduler.lr_lambdas[0](made - 1) if made else 0.0
    if isinstance(scheduler, WarmupPlateau) and scheduler.updates <= scheduler.warmup:
        return scheduler.peaks[0] * scheduler.updates / scheduler.warmup if scheduler.updates else 0.0
    return float(scheduler.optimizer.param_groups[0]["lr"])  # a tensor under --cuda-graphs


# how an optimizer runs, not where it is: this run's, whatever the checkpoint's run used
_EXECUTION = ("fused", "foreach", "capturable", "differentiable")


def load_optimizer(optimizer, state: dict) -> None:
    """Restore an optimizer's state (a resume) but keep how it runs as built now (`_EXECUTION`):
    load_state_dict takes every group field from the checkpoint, so a CPU run's checkpoint resumed
    on a GPU turned fused AdamW off (fused None) and left its step counts on the CPU, which a
    capturable step (--cuda-graphs) refuses. Torch places each step count by the group's settings
    as loaded: on the parameter's device for fused or capturable AdamW."""
    groups = [{**saved, **{k: now[k] for k in _EXECUTION if k in now}}
              for saved, now in zip(state["param_groups"], optimizer.param_groups)]
    optimizer.load_state_dict({**state, "param_groups": groups})


def load_scheduler(scheduler, state: dict, lr: float, total: int | None = None) -> None:
    """Restore a schedule's position (a resume) but keep its settings as built now: the peak `lr`
    and the warmup / floor of the schedule function (LambdaLR saves its callable objects' fields,
    and would bring the checkpoint's back); a cosine's length is `total` where given (the resumed
    run's count: `progress.count_steps`). With unchanged settings the lr is the
    checkpoint's, bit for bit. Plateau restores its position (its lr continues, halvings included)
    but keeps the warmup as built now (a checkpoint from before plateau had one is past it)."""
    if isinstance(scheduler, WarmupPlateau):
        warmup = scheduler.warmup
        scheduler.load_state_dict({"updates": warmup, "peaks": scheduler.peaks, **state, "warmup": warmup})
        scheduler.ramp()
        return
    fns = scheduler.lr_lambdas
    for fn in fns:
        if isinstance(fn, WarmupCosine) and total is not None:
            fn.total = max(1, total)
    # LambdaLR.load_state_dict updates its functions' fields in place from the state's: None skips that
    scheduler.load_state_dict({**state, "lr_lambdas": [None] * len(fns)})
    scheduler.base_lrs = [lr for _ in scheduler.base_lrs]
    for group, fn in zip(scheduler.optimizer.param_groups, fns):
        group["initial_lr"], group["lr"] = lr, lr * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]


def build_optimizer(model, lr: float, weight_decay: float, betas=(0.9, 0.98), eps: float = 1e-9, fused: bool = False):
    """AdamW; weight decay on matrices only (not biases, LayerNorm gains, the [CLS] vector)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, **({"fused": True} if fused else {}))
