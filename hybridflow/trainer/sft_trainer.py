"""Supervised fine-tuning loop (a warm start before RL): one optimizer step per batch of
``data.train_batch_size`` sequences, validation NLL per epoch, HF checkpoint at the end."""
from __future__ import annotations

import math
import time

from hybridflow.protocol import DataProto


class SFTTrainer:
    def __init__(self, cfg, group, train_loader, val_loader, tracker, progress: bool = True):
        self.cfg, self.group, self.tracker, self.progress = cfg, group, tracker, progress
        self.train_loader, self.val_loader = train_loader, val_loader
        t = cfg.trainer
        per_epoch = len(train_loader) * t.total_epochs
        self.total_steps = min(t.total_training_steps, per_epoch) if t.total_training_steps else per_epoch
        self.global_step = 0

    def fit(self) -> list[dict]:
        from tqdm import tqdm

        history = []
        bar = tqdm(total=self.total_steps, desc="sft", unit="step", disable=not self.progress, dynamic_ncols=True)
        epoch = self.train_loader.epoch
        while self.global_step < self.total_steps:
            batch = DataProto.from_single_dict(self.train_loader.next_batch())
            self.global_step += 1
            t0 = time.perf_counter()
            metrics = _first(self.group.train_step(batch))
            metrics = {("train/" + k if "/" not in k else k): v for k, v in metrics.items()}
            metrics["timing_s/step"] = time.perf_counter() - t0
            last = self.global_step == self.total_steps
            if self.val_loader is not None and (self.train_loader.epoch != epoch or last):
                metrics.update(self.validate())
                epoch = self.train_loader.epoch
            self.tracker.log(metrics, step=self.global_step)
            history.append({"step": self.global_step, **metrics})
            bar.update(1)
            bar.set_postfix(nll=f"{metrics.get('train/nll', float('nan')):.3f}")
        bar.close()
        return history

    def validate(self) -> dict:
        nll, tokens = 0.0, 0.0
        for batch_dict in self.val_loader:
            out = self.group.eval_nll(DataProto.from_single_dict(batch_dict))
            nll += float(out.batch["nll_sum"].sum())
            tokens += float(out.batch["tokens"].sum())
        mean = nll / max(tokens, 1.0)
        return {"val/nll": mean, "val/perplexity": math.exp(min(mean, 50.0))}


def _first(results):
    return results[0] if isinstance(results, list) else results
