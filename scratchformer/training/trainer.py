"""The training loop as an object: `Trainer.fit()` steps, validates, saves and stops; `train()` runs it all.

One optimizer step is a group of grad_accum batches (nanoGPT's linear loop for its body);
validation every --eval-every steps or at each epoch's end drives best.pt, early stopping and
the plateau schedule. Checkpoints hold everything an exact resume needs: model, optimizer,
schedule, GradScaler, every rank's RNG states and the position inside the epoch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from contextlib import nullcontext
from itertools import islice
from pathlib import Path

import torch
from tqdm import tqdm

from .. import data as D
from ..checkpoint import load_checkpoint, prune_checkpoints, rng_state, save_checkpoint, set_rng_state
from ..compile import compile_model
from ..evaluation.evaluate import autocast_for, evaluate, format_metrics, loss_terms
from ..model import ModelConfig
from . import weight_cast
from .build import TrainData
from .config import ConfigError, TrainConfig
from .cuda_graph import ShapeGraphs, portable
from .distributed import Dist, wrap_ddp
from .ema import WeightEMA
from .launch import create_trainer, precision_for
from .optim import (
    HIGHER_IS_BETTER,
    batch_loss,
    build_optimizer,
    build_scheduler,
    load_optimizer,
    load_scheduler,
    lr_taken,
    rdrop_loss,
)
from .progress import Progress, Window, count_steps, resumed_steps
from .report import final_report
from .runs import Logger, release_run_folders
from .stopping import check_finite, stop_on_signals

# Under DDP, the steps between two agreements on whether to stop (_check_time): each is a broadcast,
# which waits for the GPU (a host sync); --time-budget / --time-limit are decisions in seconds.
TIME_SYNC_EVERY = 16


class Trainer:
    """Trains `model` on `data` as `config` says. Build one with `Trainer.create(config)`, or by hand
    (tests): the model on `device`, the run folder `out`, a Logger."""

    def __init__(self, config: TrainConfig, model: torch.nn.Module, data: TrainData, *, model_config: ModelConfig,
                 out: Path, device: torch.device, log: Logger, dist: Dist | None = None, started: float | None = None):
        config = dataclasses.replace(config, precision=precision_for(config.precision, device))  # "auto" -> a dtype
        self.config, self.model, self.data, self.model_config = config, model, data, model_config
        self.out, self.device, self.log, self.dist = out, device, log, dist or Dist()
        self.net = wrap_ddp(model, self.dist, device)
        if config.compile:  # the training step runs compiled; checkpoints hold self.model's (uncompiled) state
            self.net = compile_model(self.net, backend=config.compile, mode=config.compile_mode)
        self.weight_cast = weight_cast.for_step(model, config, ddp=self.dist.on)  # autocast's weight casts, once a step
        cfg = config
        self.sampler = D.BucketBatchSampler(data.train_set.lengths, batch_size=cfg.batch_size,
                                            max_tokens=cfg.max_tokens, shuffle=True, seed=cfg.seed,
                                            num_replicas=self.dist.world, rank=self.dist.rank,
                                            pad_multiple=cfg.pad_multiple)
        self.loader = D.make_loader(data.train_set, self.sampler, num_workers=cfg.num_workers,
                                    pin_memory=device.type == "cuda", pad_multiple=cfg.pad_multiple, seed=cfg.seed)
        if self.sampler.batches_per_epoch(0) == 0:  # an epoch without a batch would loop for ever
            raise D.DataError(f"no training batch: {len(data.train_set)} training examples for {self.dist.world} "
                              f"process(es); check --max-train-examples and the train split")
        # Training ends after --max-steps or --epochs, whichever comes first (neither: one epoch).
        self.epochs: int | None = cfg.epochs or (None if cfg.max_steps else 1)
        self.total_steps: int = count_steps(self.sampler.batches_per_epoch, cfg.grad_accum, self.epochs, cfg.max_steps)
        self.optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.adam_betas, cfg.adam_eps,
                                         fused=device.type == "cuda")
        self.scheduler = build_scheduler(self.optimizer, cfg.schedule, warmup=cfg.warmup_steps, total=self.total_steps,
                                         min_lr=cfg.min_lr, peak=cfg.lr, patience=cfg.plateau_patience,
                                         metric_mode="max" if cfg.best_metric in HIGHER_IS_BETTER else "min")
        self.scaler = torch.amp.GradScaler(device.type, enabled=cfg.precision == "fp16")
        self.ema = WeightEMA(model, cfg.ema)  # --ema: the average validation and checkpoints hold (0: none)
        self.progress = Progress()
        self.last_saved: int = -1  # step of the last step checkpoint
        self.saved_progress: dict | None = None  # the progress last.pt holds
        self.stop_reason: str | None = None  # why fit() stopped before its end: --time-limit, SIGINT, SIGTERM
        self._t_start: float = time.time()  # this session's training start (--time-budget's clock)
        self._started: float = self._t_start if started is None else started  # the command's: --time-limit's
        self._seconds_before: float = 0.0  # the run's training time before this session
        self.train_seconds: float = 0.0  # the run's training time, every session, when fit() returns
        self.eval_max_tokens: int = max(cfg.max_tokens or 0, 4096)
        self._window = Window()
        self._resumed_window: dict | None = None  # a resumed checkpoint's train-row sums (fit goes on with them)
        self._bar: tqdm | None = None
        self.graphs: ShapeGraphs | None = None  # --cuda-graphs: made at the first step (after a resume's optimizer)

    # --- building a run ---------------------------------------------------------------------

    @classmethod
    def create(cls, config: TrainConfig, given: frozenset[str] = frozenset()) -> Trainer:
        """A new run from `config`, or with --resume the run in the checkpoint, continued exactly.
        `given`: the options set on the command line (they override a resumed run's). See `launch`."""
        return create_trainer(cls, config, given)

    # --- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """The checkpoint: everything `resume` needs. Every rank calls it (its own states are gathered)."""
        rng = self.dist.per_rank(rng_state(self.device))
        optimizer, scheduler = self.optimizer.state_dict(), self.scheduler.state_dict()
        portable(optimizer, scheduler)  # plain numbers (--cuda-graphs keeps device tensors): any run resumes it
        return {
            "version": 1, **self.ema.checkpoint(), "optimizer": optimizer, "scheduler": scheduler,
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "rng": rng, "progress": self.progress.to_dict(), "window": self.dist.per_rank(self._window.to_dict()),
            "total_steps": self.total_steps,
            "config": self.model_config.to_dict(), "args": self.config.to_dict(), "data": self.data.source.to_dict(),
            "train_data": self.data.train_id, "valid_data": self.data.valid_id,
            "tokenizers": self.data.tokenizers.to_dict(), "task": self.data.task, "num_classes": self.data.num_classes,
        }

    def save(self, kind: str) -> None:
        """kind "step": step_<N>.pt and last.pt (older step files pruned); "best": best.pt. Rank 0 writes."""
        check_finite(self, "before saving")
        if kind == "step":
            self.progress.seconds = self._elapsed()
        ckpt = self.state_dict()
        if kind == "step":
            self.last_saved, self.saved_progress = self.progress.step, self.progress.to_dict()

        def write() -> None:  # on rank 0; what it raises (a full disk), every rank raises: `Dist.on_main`
            names = ["best.pt"] if kind == "best" else [f"step_{self.progress.step:07d}.pt", "last.pt"]
            for name in names:
                save_checkpoint(self.out / name, ckpt)
            if kind == "step":
                prune_checkpoints(self.out, self.config.keep_checkpoints, upto=self.progress.step)
        self.dist.on_main(write)

    def resume(self, checkpoint: dict | str | Path) -> None:
        """Continue from a checkpoint (a dict from `state_dict`, or its file): weights, optimizer,
        schedule, scaler, progress and this rank's RNG states."""
        ckpt, cfg = checkpoint if isinstance(checkpoint, dict) else load_checkpoint(checkpoint), self.config
        self.ema.load(ckpt)  # the weights: the model's, and --ema's average
        load_optimizer(self.optimizer, ckpt["optimizer"])  # how it runs stays this run's (fused on a GPU)
        self.progress = p = Progress(**ckpt["progress"])
        self.total_steps = resumed_steps(ckpt, cfg, self.sampler.batches_per_epoch, self.epochs, self.total_steps)
        load_scheduler(self.scheduler, ckpt["scheduler"], cfg.lr, self.total_steps)  # today's lr, warmup, length
        if ckpt.get("scaler"):
            self.scaler.load_state_dict(ckpt["scaler"])
        self._resumed_window = self.dist.own(ckpt.get("window"))  # None before 2026-12-02: a new window
        p.resumed(cfg.time_budget, cfg.patience)  # larger ones go on
        set_rng_state(self.dist.own(ckpt["rng"]), self.device)  # as many as ranks (`check_world`)
        self.log.info(f"resumed from {self.config.resume_path}: step {p.step}, epoch {p.epoch + 1}, batch {p.batch}")

    # --- the loop ---------------------------------------------------------------------------

    def done(self) -> bool:
        """Whether training ended at this step: --max-steps reached, early stopping, --time-budget
        spent (the last epoch's end is `fit`'s)."""
        prog, max_steps = self.progress, self.config.max_steps
        return (max_steps is not None and prog.step >= max_steps) or prog.stopped_early or prog.out_of_time

    def fit(self) -> Progress:
        """Train to the step budget, the last epoch or early stopping; the last step is always
        validated and saved."""
        cfg, prog = self.config, self.progress
        self.model.train()
        self._bar = tqdm(total=self.total_steps, initial=prog.step, desc="train", dynamic_ncols=True, mininterval=0.5,
                         disable=True if cfg.no_progress or not self.dist.main else None)  # None: on a terminal only
        self._window = Window.from_dict(self._resumed_window)
        self._t_start, self._seconds_before = time.time(), prog.seconds
        if prog.step:  # a resumed run may have spent its --time-budget already (it ends at once); a new one steps
            self._check_time(force=True)
        with stop_on_signals(self):
            while not self.done() and not (self.epochs and prog.epoch >= self.epochs):
                if not self._epoch():
                    break
                prog.epoch += 1
                prog.batch = 0
                # an epoch ends with a validation, once: a run whose last step ended its epoch left the
                # epoch open (training ended inside it) and validated; resumed, that epoch closes here
                if not cfg.eval_every and prog.validated != prog.step:
                    with self._window.paused():  # not in the train row's throughput
                        self.validate()
                        if not cfg.save_every:
                            self.save("step")
        self._bar.close()
        self.train_seconds = self._elapsed()
        if self.graphs is not None:
            self.log.info(self.graphs.describe())
        if self.stop_reason:  # stopped early: save where it stands (no validation); --resume continues exactly
            if self.saved_progress != prog.to_dict():
                self.save("step")
            self.log.info(f"{self.stop_reason}: stopped at step {prog.step} of {self.total_steps}, saved "
                          f"{self.out / 'last.pt'}; continue with --resume --out {self.out}")
            return prog
        if prog.validated != prog.step:
            self.validate()  # the last steps were not validated yet
        if self.saved_progress != prog.to_dict():  # last.pt is written after the final validation: its best is current
            self.save("step")
        return prog

    def _epoch(self) -> bool:
        """The rest of the current epoch; False when training ended inside it."""
        self.data.train_set.set_epoch(self.progress.epoch)  # before the loader's iterator (and its workers) exist
        self.sampler.set_epoch(self.progress.epoch, start=self.progress.batch)
        batches = iter(self.loader)
        while group := list(islice(batches, self.config.grad_accum)):
            loss_sum, nll_sum, ntok, gnorm = self.train_step(group)
            self._after_step(loss_sum, nll_sum, ntok, gnorm)
            self._check_time()
            if self.done() or self.stop_reason is not None:
                return False
        return True

    def _elapsed(self) -> float:
        """The run's training time so far: the sessions before this one, and this one."""
        return self._seconds_before + time.time() - self._t_start

    def _check_time(self, force: bool = False) -> None:
        """After a step (or at a resumed start: `force`): once the run's training time (every
        session) reaches --time-budget, training ends as at its last step (done(): final
        validation, report); once this session passes --time-limit it stops after this step and
        saves (stop_reason, which SIGINT / SIGTERM set outside DDP: stopping.py). Under DDP rank 0
        decides for all (ranks that stopped at different steps would hang in all-reduce), in one
        broadcast every TIME_SYNC_EVERY steps: a collective is a host sync, and these decisions
        are in seconds."""
        cfg, prog = self.config, self.progress
        timed = cfg.time_budget or cfg.time_limit
        if self.dist.on and (not timed or (not force and prog.step % TIME_SYNC_EVERY)):
            return
        if cfg.time_limit and self.stop_reason is None and time.time() - self._started >= cfg.time_limit:
            self.stop_reason = f"--time-limit {cfg.time_limit:g} s"
        spent = bool(cfg.time_budget) and not prog.out_of_time and self._elapsed() >= cfg.time_budget
        if self.dist.on:
            spent, self.stop_reason = self.dist.broadcast((spent, self.stop_reason))
        if spent:
            prog.out_of_time = True
            self.log.info(f"--time-budget {cfg.time_budget:g} s spent: training ends at step {prog.step} of "
                          f"{self.total_steps}")

    def train_step(self, group: list[D.Batch]) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
        """One optimizer step over a group of batches -> (loss sum, NLL sum, target tokens, grad norm),
        the sums and the norm as 0-dim fp32 tensors on the device. With --cuda-graphs the update
        replays its batch shape's CUDA graph (`ShapeGraphs`).

        The loss is divided by the group's target tokens (examples for classification, sentences for
        extraction), under DDP by their mean over the ranks (DDP averages the ranks' gradients): the
        accumulated batches, and every rank's together, weigh as one big batch. DDP syncs gradients
        on the group's last batch only.
        Nothing here reads a value on the host (an fp16 GradScaler aside): the figures stay on the
        device until a train row is logged, so the host queues the next step while this one runs. A
        step whose fp16 gradients overflowed (the GradScaler skips its update) counts, but does not
        move the schedule (Hugging Face's Trainer too): a warmup is of updates made.
        """
        ntok = sum(b.num_tgt_tokens for b in group)
        if self.config.cuda_graphs and self.graphs is None:
            self.graphs = ShapeGraphs(self._update, self.optimizer, self.device)
        scale = self.scaler.get_scale() if self.scaler.is_enabled() else None  # fp16: read on the host anyway
        if self.graphs is not None:
            loss_total, nll_total, gnorm = self.graphs(group, ntok)
        else:
            loss_total, nll_total, gnorm = self._update([b.to(self.device, non_blocking=True) for b in group],
                                                        self.dist.mean(ntok, self.device))
        self.ema.update(self.progress.step + 1)
        self.optimizer.zero_grad(set_to_none=True)
        if scale is not None and self.scaler.get_scale() < scale:  # an overflow: the scaler skipped the update
            self.log.info(f"step {self.progress.step + 1}: gradients overflowed fp16, the update skipped (the "
                          f"schedule waits for it); loss scale now {self.scaler.get_scale():g}")
        else:
            self.scheduler.step()
        self.progress.step += 1
        self.progress.batch += len(group)
        self.progress.tokens += ntok
        return loss_total, nll_total, ntok, gnorm

    def _update(self, group: list[D.Batch], ntok: int | torch.Tensor,
                graphed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward, backward, clipping and the optimizer's step over batches on the device (no
        zero_grad) -> (loss sum, NLL sum, grad norm); the loss is divided by `ntok` (`train_step`).
        `graphed`: run or captured for a CUDA graph (autocast without its cache of cast weights)."""
        cfg = self.config
        loss_total = nll_total = torch.zeros((), device=self.device)
        for i, batch in enumerate(group):
            sync = self.net.no_sync() if self.dist.on and i < len(group) - 1 else nullcontext()
            with sync:
                with autocast_for(self.device, cfg.precision, cache=not graphed), self.weight_cast():
                    if cfg.rdrop:  # both copies' logits, for their KL
                        logits, target = loss_terms(self.net, batch.twice())
                        loss, nll = rdrop_loss(self.data.task, logits, target, cfg.label_smoothing, cfg.rdrop)
                    else:
                        loss, nll = batch_loss(self.net, batch, self.data.task, cfg.label_smoothing)
                self.scaler.scale(loss / ntok).backward()
            loss_total = loss_total + loss.detach()
            nll_total = nll_total + nll.detach()
        self.scaler.unscale_(self.optimizer)
        clip = cfg.clip_norm if cfg.clip_norm > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip).detach().float()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss_total, nll_total, gnorm

    def _after_step(self, loss_sum: torch.Tensor, nll_sum: torch.Tensor, ntok: int, gnorm: torch.Tensor) -> None:
        """Log a train row every --log-every steps; validate and save when due."""
        cfg, step, w = self.config, self.progress.step, self._window
        w.loss, w.nll, w.tokens = w.loss + loss_sum, w.nll + nll_sum, w.tokens + ntok
        if step % cfg.log_every == 0 or step == 1:
            self._log_train_row(gnorm)
        self._bar.update(1)
        validated = bool(cfg.eval_every) and step % cfg.eval_every == 0
        with self._window.paused():  # not in the train row's throughput
            if validated:
                self.validate()
            if (cfg.save_every and step % cfg.save_every == 0) or (validated and not cfg.save_every):
                self.save("step")

    def _log_train_row(self, gnorm: torch.Tensor) -> None:
        prog, w = self.progress, self._window
        # the host reads them here only; under DDP every rank's share of the window (rank 0's was one shard's)
        loss, nll, tokens = self.dist.sum([w.loss, w.nll, w.tokens], self.device)
        lr, gnorm = lr_taken(self.scheduler), float(gnorm)
        dt = max(1e-9, time.time() - w.t0)
        row = {"split": "train", "step": prog.step, "epoch": prog.step_epoch, "loss": loss / max(1, tokens),
               "nll": nll / max(1, tokens), "lr": lr, "grad_norm": gnorm, "tokens_per_s": tokens / dt}
        self.dist.on_main(lambda: self.log.row(row))  # what rank 0 raises (a log it cannot write), every rank raises
        unit = {"classification": "ex", "extractive": "sent"}.get(self.data.task, "tok")
        self._bar.set_postfix(loss=f"{row['loss']:.3f}", lr=f"{lr:.2e}", **{f"{unit}/s": f"{row['tokens_per_s']:.0f}"})
        self.log.info(f"step {prog.step:>6} | epoch {prog.step_epoch} | loss {row['loss']:.4f} | "
                      f"nll {row['nll']:.4f} | lr {lr:.2e} | grad {gnorm:.2f} | {row['tokens_per_s']:.0f} {unit}/s")
        check_finite(self, "at the train row")
        self._window = Window()

    # --- validation -------------------------------------------------------------------------

    def validate(self) -> dict:
        """Validation loss (and decoding metrics on the first --eval-decode-examples) on rank 0;
        then best.pt, early stopping and the plateau schedule, the same on every rank."""
        cfg, prog = self.config, self.progress
        check_finite(self, "before validating")
        res, prog.validated = {}, prog.step

        def on_rank_0() -> dict:
            decode = 0 if self.data.task == "classification" else cfg.eval_decode_examples
            ev = evaluate(self.model, self.data.valid_set, self.data.valid_examples, self.data.tokenizers,
                          device=self.device, max_tgt_len=cfg.max_tgt_len, limit=decode,
                          max_tokens=self.eval_max_tokens, precision=cfg.precision,
                          summary_sentences=cfg.summary_sentences, summary_words=cfg.summary_words)
            res.update({**ev.metrics, **next(iter(ev.decodings.values()), {})})  # greedy (or the extracts)
            self.log.row({"split": "valid", "step": prog.step, "epoch": prog.step_epoch, **res})
            self.log.info(f"valid step {prog.step}: {format_metrics(res)}")
            self._track_best(res)
            return prog.to_dict()
        # rank 0 decided best / early stopping, the others follow; what it raised (a full disk), each raises
        with self.ema.swapped():  # --ema: the average is validated
            for k, v in self.dist.on_main(on_rank_0).items():
                setattr(prog, k, v)
        if cfg.schedule == "plateau":
            self.scheduler.step(prog.best if prog.best is not None else math.nan)  # no best yet (NaN): no gain
        if prog.best_step == prog.step:
            self.save("best")
        self.model.train()
        return res

    def _track_best(self, res: dict) -> None:
        cfg, prog = self.config, self.progress
        if cfg.best_metric not in res:
            raise ConfigError(f"--best-metric {cfg.best_metric} is not computed here; have {sorted(res)}")
        if prog.track(cfg.best_metric, res[cfg.best_metric], cfg.patience):
            self.log.info(f"early stopping: {cfg.best_metric} did not improve for {cfg.patience} evaluations "
                          f"(best {prog.best:.4f} at step {prog.best_step})")

    def close(self) -> None:
        self.log.close()
        self.dist.close()


def train(config: TrainConfig, given: frozenset[str] = frozenset()) -> dict:
    """Train one run end to end: build (or resume), fit, final report. Returns the final
    validation metrics (empty on ranks other than 0)."""
    threads = torch.get_num_threads()
    try:
        trainer = Trainer.create(config, given)
        trainer.fit()
        if trainer.stop_reason is not None:  # not finished: no final report
            trainer.close()
            if trainer.stop_reason.startswith("SIG"):
                raise KeyboardInterrupt  # a command that was asked to stop says so (exit 130)
            return {"stopped": trainer.stop_reason, "step": trainer.progress.step}
        final = trainer.dist.on_main(lambda: final_report(trainer))  # rank 0's; what it raises, every rank's
        trainer.close()
        return final if trainer.dist.main else {}
    finally:
        torch.set_num_threads(threads)  # --threads is for this run, not for the caller's process
        release_run_folders()
