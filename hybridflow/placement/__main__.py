"""``python -m hybridflow.placement``: plan a PPO workload on a cluster that need not be here.

Prints the chosen plan, the best alternatives (the best plan of each placement and allocation) with
predicted step time and peak memory per device, and the rejected plans counted by what did not
fit. Starts nothing: no Ray, no torch.distributed, no GPU.

    python -m hybridflow.placement --actor 70b --critic 70b --reward-model 70b --nodes 16 \\
        --gpus-per-node 8 --device h100 [--prompts 1024 --response-len 1024] [--top 5] [--json]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from hybridflow.model_files import read_json
from hybridflow.placement.devices import PROFILES, Cluster, device_by_name
from hybridflow.placement.planner import PlanResult, plan
from hybridflow.placement.workload import ALIASES, CATALOG, ModelShape, Workload, model_by_name

GiB = 2 ** 30


def _model(spec: str | None) -> ModelShape | None:
    """A catalog name (7b, llama-2-70b, ...), an HF config.json or a folder holding one; none = no model."""
    if spec is None or spec.lower() == "none":
        return None
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if os.path.isfile(path):
        return ModelShape.from_hf_config(read_json(path), name=os.path.basename(os.path.dirname(os.path.abspath(path))))
    return model_by_name(spec)


def parse_args(argv=None) -> argparse.Namespace:
    names = ", ".join(sorted(ALIASES) + sorted(CATALOG))
    p = argparse.ArgumentParser(prog="python -m hybridflow.placement", description=__doc__.split("\n\n")[0])
    p.add_argument("--actor", required=True, help=f"model: {names}, or an HF config.json / checkpoint folder")
    p.add_argument("--critic", default=None, help="critic model (default: none, as GRPO)")
    p.add_argument("--reward-model", default=None, help="reward model (default: none, a rule reward)")
    p.add_argument("--no-reference", action="store_true", help="no reference policy (no KL)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--device", default="h100", help=f"one of {sorted(PROFILES)}")
    p.add_argument("--prompts", type=int, default=1024, help="prompts per step (data.train_batch_size)")
    p.add_argument("--samples-per-prompt", type=int, default=1, help="rollout.n")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--ppo-epochs", type=int, default=1)
    p.add_argument("--mini-batches", type=int, default=1, help="updates per epoch (batch / ppo_mini_batch_size)")
    p.add_argument("--micro-batch", type=int, default=2, help="sequences per device per pass")
    p.add_argument("--no-recompute", action="store_true", help="no activation checkpointing")
    p.add_argument("--one-step-off", action="store_true",
                   help="a separate rollout pool generates the next batch during training (off-policy by a step)")
    p.add_argument("--no-old-log-prob", action="store_true",
                   help="the run skips the actor's pi_old forward (strictly on policy, or the sampler's log-probs)")
    p.add_argument("--placements", default=None,
                   help="comma list of placements to consider: colocate,split,separate,rm-pool,standalone,"
                        "async-rollout (default all; the runtime here runs all but split and standalone)")
    p.add_argument("--strategies", default=None, help="comma list of training layouts: fsdp,megatron (default both)")
    p.add_argument("--top", type=int, default=5, help="alternatives to print")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.parse_args(argv)
    for name in ("nodes", "gpus_per_node", "prompts", "samples_per_prompt", "prompt_len", "response_len",
                 "ppo_epochs", "mini_batches", "micro_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return a


def build(a: argparse.Namespace) -> tuple[Workload, Cluster]:
    actor = _model(a.actor)
    if actor is None:
        raise ValueError("--actor is needed (a model name or an HF config)")
    w = Workload(actor=actor, critic=_model(a.critic), reference=not a.no_reference,
                 reward_model=_model(a.reward_model), prompts=a.prompts, samples_per_prompt=a.samples_per_prompt,
                 prompt_len=a.prompt_len, response_len=a.response_len, ppo_epochs=a.ppo_epochs,
                 mini_batches=a.mini_batches, micro_batch=a.micro_batch, recompute=not a.no_recompute,
                 one_step_off=a.one_step_off, old_log_prob=not a.no_old_log_prob)
    return w, Cluster(a.nodes, a.gpus_per_node, device_by_name(a.device))


def alternatives(result: PlanResult, top: int) -> list:
    """The best plan of each placement and pool allocation, fastest first (layout variants of one
    allocation differ by little and would crowd the list)."""
    seen, out = set(), []
    for e in result.feasible:
        key = (e.plan.placement, tuple(p.slots for p in e.plan.pools))
        if key not in seen:
            seen.add(key)
            out.append(e)
    return out[:top + 1]


def _clean(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def as_json(w: Workload, c: Cluster, r: PlanResult, top: int) -> dict:
    rejected = {}
    for e in r.estimates:
        if not e.feasible:
            key = e.reason.split(":", 1)[0]
            rejected.setdefault(key, {"count": 0, "example": e.reason, "plan": e.plan.describe()})["count"] += 1
    alts = alternatives(r, top)
    return _clean({
        "workload": {"actor": w.actor.name, "actor_params": w.actor.params,
                     "critic": w.critic.name if w.critic else None, "reference": w.reference,
                     "reward_model": w.reward_model.name if w.reward_model else None, "prompts": w.prompts,
                     "samples_per_prompt": w.samples_per_prompt, "prompt_len": w.prompt_len,
                     "response_len": w.response_len, "ppo_epochs": w.ppo_epochs, "mini_batches": w.mini_batches,
                     "micro_batch": w.micro_batch, "recompute": w.recompute, "one_step_off": w.one_step_off,
                     "old_log_prob": w.old_log_prob},
        "cluster": {"nodes": c.nodes, "slots_per_node": c.slots_per_node, "device": c.device.name,
                    "device_source": c.device.source},
        "planning_s": r.seconds, "stats": r.stats,
        "chosen": r.best.to_dict() if r.best else None,
        "alternatives": [e.to_dict() for e in alts[1:]],
        "rejected": rejected,
    })


def _mem_line(e) -> str:
    parts = []
    for role, m in e.memory.items():
        comp = " ".join(f"{k[:3]} {v / GiB:.1f}" for k, v in m.items() if k != "total" and v > 0)
        parts.append(f"{role} {m.get('total', 0) / GiB:.1f} ({comp})")
    return "; ".join(parts)


def as_text(w: Workload, c: Cluster, r: PlanResult, top: int) -> str:
    roles = ", ".join(f"{x} {w.model_of(x).name}" for x in w.roles)
    lines = [f"workload: PPO {roles}; {w.prompts}x{w.samples_per_prompt} sequences of {w.prompt_len}+"
             f"{w.response_len} tokens, {w.ppo_epochs} epoch(s) x {w.mini_batches} update(s)",
             f"cluster: {c.nodes} node(s) x {c.slots_per_node} {c.device.name} ({c.device.source})",
             f"planned in {r.seconds:.2f} s: {r.stats['plans_simulated']} plans simulated, "
             f"{r.stats['feasible']} feasible ({r.stats['allocations']} placements/allocations, "
             f"{r.stats['layouts_costed']} role layouts costed)", ""]
    best = r.best
    if best is None:
        lines.append("no plan fits: every candidate runs out of device memory")
    else:
        stages = ", ".join(f"{k} {v:.1f}" for k, v in best.stages.items())
        lines += [f"chosen: {best.plan.describe()}" + ("" if best.plan.runnable_here else " *"),
                  f"  predicted step {best.step_s:.1f} s ({stages}; decode batch per replica "
                  f"{best.extra.get('decode_batch_per_replica')})",
                  "  peak memory per device: " + ", ".join(f"{p} {b / GiB:.1f} GiB" for p, b in best.peak_bytes.items()),
                  "  per role (GiB/device): " + _mem_line(best), ""]
        alts = alternatives(r, top)[1:]
        if alts:
            lines.append("alternatives (best of each placement and allocation):")
            lines.append(f"  {'step s':>8} {'x best':>7} {'peak GiB':>8}  plan")
            for e in alts:
                mark = "" if e.plan.runnable_here else " *"
                lines.append(f"  {e.step_s:8.1f} {e.step_s / best.step_s:7.2f} {e.peak / GiB:8.1f}  {e.plan.describe()}{mark}")
            lines.append("")
        if not all(e.plan.runnable_here for e in [best] + alts):
            lines += ["* the paper's placement, planned but not built in this runtime (it runs colocate, separate,",
                      "  rm-pool, async-rollout; --placements colocate,separate,rm-pool,async-rollout plans only those)", ""]
    rej = r.rejected_by_reason()
    if rej:
        lines.append(f"rejected ({sum(rej.values())} plans, by what did not fit):")
        shown = set()
        for e in r.estimates:
            key = e.reason.split(":", 1)[0]
            if not e.feasible and key not in shown:
                shown.add(key)
                lines.append(f"  {rej[key]:6d}  {e.reason}")
    return "\n".join(lines)


def main(argv=None) -> int:
    a = parse_args(argv)
    try:
        w, c = build(a)
    except (KeyError, ValueError, OSError) as e:
        print(f"python -m hybridflow.placement: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    split = lambda v: tuple(x.strip() for x in v.split(",") if x.strip()) if v else None
    r = plan(w, c, placements=split(a.placements), strategies=split(a.strategies))
    print(json.dumps(as_json(w, c, r, a.top)) if a.json else as_text(w, c, r, a.top))
    return 0 if r.best else 1


if __name__ == "__main__":
    sys.exit(main())
