"""The placement planner against the runtime: predicted vs measured PPO step time, one invocation.

PPO with a critic, a reference (KL loss) and a reward model, all at the e2e medium size (Qwen2-style,
hidden 512, 8 layers, ~25M parameters each; scripts/bench/e2e.py's models and arithmetic data),
32 prompts x 4 samples, responses of 16 tokens, on this machine's slots. The planner
(``trainer.placement=auto``'s path: calibration, then ``hybridflow/placement/``) predicts every plan
the runtime can run here; each of up to ``--max-plans`` of them is then run with the real recipe
(``python -m recipes.main_ppo --config-name ppo`` + the plan's overrides; the planner's choice
is run as ``trainer.placement=auto`` itself in the first round) for ``--steps`` steps,
in turns (``--rounds`` > 1 runs every plan again, in reverse order, and takes the median: the
machine's slow spells then hit every plan), and the JSON says:

- per plan: predicted step time, stages and peak memory per slot; every measured step time after the
  warm-up, their fastest (``measured_step_s``) and median, and the stages;
- ``spearman``: rank correlation of predicted and measured (fastest) step times (goal >= 0.8);
- ``chosen_over_best``: the measured time of the planner's choice over the best measured (goal <= 1.10);
- the same two over the medians (``*_median``). The fastest is the headline: other processes on a
  shared machine only ever add time to a step (calibration takes the best of its repeats too).

The cost model's CPU terms come from the calibration alone (``hybridflow/placement/calibrate.py``,
run before any plan is measured, cached); nothing measured here feeds back into a prediction.

    flock /tmp/hf_cpu.lock .venv/bin/python scripts/bench/planner.py                 # measures
    .venv/bin/python scripts/bench/planner.py --plan-only                             # predictions only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from e2e import REPO, build_assets, run_recipe, summarise  # noqa: E402  (the e2e bench's models, data, medians)

sys.path.insert(0, REPO)


def rank(values: list[float]) -> list[float]:
    """Ranks from 1, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def spearman(x: list[float], y: list[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the ranks (ties as mean ranks)."""
    if len(x) != len(y) or len(x) < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2")
    rx, ry = rank(x), rank(y)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def chosen_over_best(predicted: list[float], measured: list[float]) -> float:
    """Measured time of the plan predicted fastest over the fastest measured."""
    chosen = min(range(len(predicted)), key=lambda i: predicted[i])
    return measured[chosen] / min(measured)


def make_reward_model(path: str, size: dict) -> str:
    """A seeded Qwen2 sequence classifier (num_labels=1) of the medium size, on the char tokenizer."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import AutoModelForSequenceClassification

    from hybridflow.tiny import save_char_tokenizer, tiny_config

    cfg = tiny_config("qwen2", hidden=size["hidden"], intermediate=size["intermediate"], layers=size["layers"],
                      heads=size["heads"], kv_heads=size["kv_heads"], tied=size["tied"])
    cfg.num_labels = 1
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(cfg).save_pretrained(path)
    save_char_tokenizer(path)
    return path


def base_overrides(args, paths: dict) -> list[str]:
    model = paths["medium"]
    return [
        f"data.train_files=[{paths['data']}/train.parquet]", f"data.val_files=[{paths['data']}/val.parquet]",
        f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}",
        "reward_model.enable=true", f"reward_model.model.path={paths['rm']}",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "data.max_prompt_length=16", f"data.max_response_length={args.response_length}",
        f"data.train_batch_size={args.prompts}", f"actor_rollout_ref.rollout.n={args.samples}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}", f"critic.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={args.micro_batch}",
        f"critic.ppo_micro_batch_size_per_gpu={args.micro_batch}",
        f"critic.forward_micro_batch_size_per_gpu={args.micro_batch}",
        f"reward_model.micro_batch_size_per_gpu={args.micro_batch}",
        f"trainer.n_gpus_per_node={args.slots}", f"trainer.cpus_per_worker={args.cpus_per_worker}",
        f"trainer.total_training_steps={args.steps}",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
        "trainer.logger=[jsonl]", "trainer.resume_mode=disable", "trainer.experiment_name=bench-planner",
        *args.overrides,
    ]


def predictions(args, base: list[str]):
    """The planner's runnable candidates for the bench's config (trainer.placement=auto's path)."""
    from hybridflow.config import load_config, validate
    from hybridflow.placement.auto import plan_config
    from recipes.cli import compose_config

    user = base + ["trainer.placement=auto"]
    cfg = load_config(compose_config("ppo", user))

    def check(planned):
        validate(load_config(compose_config("ppo", user + planned)), available_slots=args.slots, check_paths=False)

    return plan_config(cfg, check, refresh=args.recalibrate, keep_combos=args.keep_combos,
                       log=lambda m: print(f"[planner] calibrating: {m}", file=sys.stderr, flush=True))


def signature(plan) -> tuple:
    """What makes two plans different to measure: placement, the actor's and the critic's layouts and
    the rollout's tp (the reference's and reward model's sharding barely move a step here)."""
    lay = plan.layouts
    return plan.placement, lay["actor"], lay.get("critic"), plan.rollout.tp


def pick(cands: list, most: int) -> list:
    """Up to ``most`` candidates, the fastest of each signature: the planner's choice and the best of
    every placement, then others spread evenly over the predicted ranking."""
    seen, distinct = set(), []
    for c in cands:
        sig = signature(c.estimate.plan)
        if sig not in seen:
            seen.add(sig)
            distinct.append(c)
    if len(distinct) <= most:
        return distinct
    keep = {0}  # the choice, and the best plan of every other placement
    for i, c in enumerate(distinct):
        if all(distinct[j].estimate.plan.placement != c.estimate.plan.placement for j in keep):
            keep.add(i)
    rest = [i for i in range(len(distinct)) if i not in keep]
    slots = max(0, most - len(keep))
    if slots and rest:
        keep |= {rest[round(k * (len(rest) - 1) / max(1, slots - 1))] for k in range(min(slots, len(rest)))}
    return [distinct[i] for i in sorted(keep)]


def measure(args, base: list[str], cand, tag: str, auto: bool = False) -> dict:
    """One recipe run of ``cand``'s plan. ``auto``: run it as ``trainer.placement=auto`` (the recipe
    plans again and must pick this plan: its "runs as:" line is checked against the overrides)."""
    run_dir = os.path.join(args.work_dir, "runs", f"planner-{tag}")
    run = run_recipe(base + (["trainer.placement=auto"] if auto else cand.overrides), run_dir, args.timeout,
                     config_name="ppo")
    if "error" in run:
        return run
    out = summarise(run["records"], args.warmup, args.prompts, args.samples)
    steps = [r["timing_s/step"] for r in run["records"] if r.get("step", 0) > args.warmup and "timing_s/step" in r]
    out["step_times_s"] = [round(x, 4) for x in steps]
    if auto:
        ran = [ln.split("runs as:", 1)[1].split() for ln in run["stderr"].splitlines() if "runs as:" in ln]
        out["auto_ran_this_plan"] = bool(ran) and ran[0] == cand.overrides
        said = run["stderr"].splitlines()
        out["auto_stderr"] = [ln for ln in said if ln.startswith(("trainer.placement=auto", "  "))][:8]
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, default=2, help="trainer.n_gpus_per_node: the slots the planner places on")
    p.add_argument("--cpus-per-worker", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--rounds", type=int, default=2, help="run every plan this many times, in alternating order")
    p.add_argument("--max-plans", type=int, default=8)
    p.add_argument("--keep-combos", type=int, default=64, help="the planner's layout combinations kept per pool "
                   "(its default prunes to a few: the bench wants the spread)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=64)
    p.add_argument("--plan-only", action="store_true", help="print the predictions, run nothing")
    p.add_argument("--resummarise", metavar="REPORT.json", help="recompute a saved report's statistics, run nothing")
    p.add_argument("--recalibrate", action="store_true", help="measure the machine again (else the cached)")
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "bench-e2e"))
    p.add_argument("--timeout", type=int, default=600)
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every run (after --)")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    if args.max_plans < 2:
        p.error("--max-plans must be at least 2 (a ranking needs two)")
    args.work_dir = os.path.abspath(args.work_dir)
    return args


def main(argv=None) -> int:
    from e2e import SIZES

    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.resummarise:
        print(json.dumps(resummarise(args.resummarise), indent=2))
        return 0
    t0 = time.perf_counter()
    paths = build_assets(args.work_dir, ["medium"])
    paths["rm"] = make_reward_model(os.path.join(args.work_dir, "models", "qwen2-medium-rm"), SIZES["medium"])
    base = base_overrides(args, paths)
    auto = predictions(args, base)
    chosen = pick(auto.candidates, args.max_plans)
    report = {"bench": "planner", "setting": {"slots": args.slots, "cpus_per_worker": args.cpus_per_worker,
                                              "prompts": args.prompts, "samples": args.samples,
                                              "response_length": args.response_length, "steps": args.steps,
                                              "warmup_steps_excluded": args.warmup, "rounds": args.rounds,
                                              "cpus": os.cpu_count(), "overrides": args.overrides},
              "device": auto.device, "planning_s": round(auto.seconds, 2), "plans_simulated": auto.planned,
              "runnable": len(auto.candidates), "skipped": auto.skipped,
              "load_avg_1m_at_start": round(os.getloadavg()[0], 2), "plans": []}
    rows = [{"plan": c.estimate.plan.describe(), "overrides": c.overrides,
             "predicted_step_s": round(c.estimate.step_s, 4), "predicted_stages": {
                 k: round(v, 4) for k, v in c.estimate.stages.items()},
             "predicted_peak_gib": round(c.estimate.peak / 2 ** 30, 3), "measured": []} for c in chosen]
    if args.plan_only:
        report["plans"] = rows
        print(json.dumps(report, indent=2))
        return 0
    for r in range(args.rounds):
        order = list(range(len(chosen)))[::(-1 if r % 2 else 1)]
        for i in order:
            res = measure(args, base, chosen[i], f"{i}-{r}", auto=(i == 0 and r == 0))
            rows[i]["measured"].append(res)
            print(f"[planner] plan {i} round {r}: predicted {rows[i]['predicted_step_s']} s, measured "
                  f"{res.get('step_s', res.get('error'))}", file=sys.stderr, flush=True)
    for row in rows:
        row["measured_step_times_s"] = [x for m in row["measured"] for x in m.get("step_times_s", [])]
        row["measured_stages"] = [m.get("timing_s") for m in row["measured"] if "timing_s" in m]
        for m in row["measured"]:
            if "auto_ran_this_plan" in m:
                row["run_as_trainer_placement_auto"] = {"ran_this_plan": m["auto_ran_this_plan"],
                                                        "stderr": m["auto_stderr"]}
        row["errors"] = [m for m in row["measured"] if "error" in m]
        del row["measured"]
    report["plans"] = rows
    report.update(summary(rows))
    report["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(report, indent=2))
    return 0 if all(r["measured_step_s"] for r in rows) else 1


def summary(rows: list[dict]) -> dict:
    """Each plan's measured step time, two ways over its steps after the warm-up (every round): the
    fastest (the headline: other processes on a shared machine only ever add time to a step, the rule
    calibrate.py's best-of repeats follow too) and the median; then, for each, Spearman's correlation
    with the predictions and the choice's time over the best measured."""
    out = {}
    for row in rows:
        steps = row.get("measured_step_times_s") or []
        row["measured_step_s"] = round(min(steps), 4) if steps else None
        row["measured_median_step_s"] = round(statistics.median(steps), 4) if steps else None
    ok = [r for r in rows if r["measured_step_s"]]
    if len(ok) >= 2:
        pred = [r["predicted_step_s"] for r in ok]
        fastest, median = [r["measured_step_s"] for r in ok], [r["measured_median_step_s"] for r in ok]
        out.update(plans_measured=len(ok), spearman=round(spearman(pred, fastest), 3),
                   chosen_over_best=round(chosen_over_best(pred, fastest), 3),
                   spearman_median=round(spearman(pred, median), 3),
                   chosen_over_best_median=round(chosen_over_best(pred, median), 3),
                   goals={"plans_measured": ">= 6", "spearman": ">= 0.8", "chosen_over_best": "<= 1.10"})
    return out


def resummarise(path: str) -> dict:
    """A saved report's statistics computed again from its step times (no run)."""
    with open(path) as f:
        report = json.load(f)
    for key in ("spearman", "chosen_over_best", "spearman_median", "chosen_over_best_median"):
        report.pop(key, None)
    report.update(summary(report["plans"]))
    return report


if __name__ == "__main__":
    sys.exit(main())
