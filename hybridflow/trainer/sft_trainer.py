"""Supervised fine-tuning loop (a warm start before RL): one optimizer step per batch of
``data.train_batch_size`` sequences, validation NLL every ``test_freq`` steps (or per epoch),
checkpoints every ``save_freq`` steps in the RL trainer's folder layout, so ``resume_mode`` and
``python scripts/export_hf.py`` work the same way for both."""
from __future__ import annotations

import math
import os
import time

from hybridflow.protocol import DataProto
from hybridflow.trainer import checkpoint as ckpt
from hybridflow.trainer.finite import stop_if_non_finite


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

        t = self.cfg.trainer
        self._maybe_resume()
        if hasattr(self.tracker, "drop_after"):  # a fresh run starts a clean record
            self.tracker.drop_after(self.global_step or -1)
        history = []
        bar = tqdm(total=self.total_steps, initial=self.global_step, desc="sft", unit="step",
                   disable=not self.progress, dynamic_ncols=True)
        save_time = {}
        while self.global_step < self.total_steps:
            batch = DataProto.from_single_dict(self.train_loader.next_batch())
            self.global_step += 1
            t0 = time.perf_counter()
            metrics = _first(self.group.train_step(batch))
            metrics = {("train/" + k if "/" not in k else k): v for k, v in metrics.items()}
            if "train/nll" in metrics:  # verl's SFT trainer names it train/loss: dashboards find both
                metrics["train/loss"] = metrics["train/nll"]
            metrics["timing_s/step"] = time.perf_counter() - t0
            last = self.global_step == self.total_steps
            epoch_done = self.train_loader.batch_in_epoch >= len(self.train_loader)
            due = self.global_step % t.test_freq == 0 if t.test_freq > 0 else epoch_done
            if self.val_loader is not None and (due or last):
                metrics.update(self.validate())
            metrics.update(save_time)  # the previous step's save, which ran after its record was logged
            # logged before the checkpoint, as in the RL trainer: a kill between the two leaves a
            # record the resume trains again (drop_after removes it); the other order lost it
            self.tracker.log(metrics, step=self.global_step)
            history.append({"step": self.global_step, **metrics})
            # a NaN/inf loss or grad_norm stops here: saving it would put NaN in every later checkpoint
            stop_if_non_finite(metrics, self.global_step, t.default_local_dir, lr_key="optim.lr")
            save_time = {}
            if t.save_freq > 0 and (self.global_step % t.save_freq == 0 or last):
                t0 = time.perf_counter()
                self.save_checkpoint()
                save_time = {"timing_s/save_checkpoint": time.perf_counter() - t0}
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
        return {"val/nll": mean, "val/loss": mean, "val/perplexity": math.exp(min(mean, 50.0))}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> str:
        """global_step_N/actor (engine + worker RNG), trainer_state.json, then the manifest and the
        tracker, in that order, as in the RL trainer: a crash mid-save leaves the previous one."""
        t = self.cfg.trainer
        path = ckpt.start_save(t.default_local_dir, self.global_step)
        with ckpt.removed_if_unfinished(path):  # a failed save (a full disk) leaves no partial folder
            self.group.save_checkpoint(os.path.join(path, "actor"))
            return ckpt.finish_save(t.default_local_dir, self.global_step, {"loader": self.train_loader.state_dict()},
                                    self.worker_layout(), t.max_ckpt_to_keep)

    def worker_layout(self) -> dict:
        return sft_worker_layout(self.cfg)

    def _maybe_resume(self) -> None:
        t = self.cfg.trainer
        found = ckpt.open_resume(t.default_local_dir, t.resume_mode, self.worker_layout())
        if found is None:
            return
        path, state = found
        self.train_loader.load_state_dict(state["loader"])  # first: it refuses other data cheaply
        self.group.load_checkpoint(os.path.join(path, "actor"))
        ckpt.set_controller_rng_state(state["rng"])
        self.global_step = state["global_step"]
        print(f"resumed from {path} at step {self.global_step}", flush=True)


def _first(results):
    return results[0] if isinstance(results, list) else results


def sft_worker_layout(cfg) -> dict:
    """The SFT run's worker layout from the config alone (see ppo_trainer.worker_layout)."""
    from hybridflow.config.derived import model_parallel

    m, t = cfg.model, cfg.trainer
    tp, pp = model_parallel(m.strategy, m.megatron)
    # fsdp_size is left out on purpose: DCP re-shards on load, so a run may resume replicated
    # from a sharded checkpoint and back (tests/workers/engines/test_fsdp_engine.py)
    return {"sft": {"world_size": t.nnodes * t.n_gpus_per_node, "strategy": m.strategy, "tp": tp, "pp": pp,
                    **ckpt.lora_layout(m)}}
