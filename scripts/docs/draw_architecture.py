"""Draw docs/images/architecture.png, the picture at the top of the README.

    .venv/bin/python scripts/docs/draw_architecture.py [--out docs/images/architecture.png]

Boxes and arrows only (matplotlib), 1200 px wide: the single controller, the worker groups it
calls, and inside the actor's group the training engine, the rollout and the resharding between
them. Edit the labels here and run it again; the PNG is committed beside the README.
"""
from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

BLUE, GREEN, ORANGE, GREY, PURPLE = "#dbe8f7", "#dff0d8", "#fde9cf", "#eeeeee", "#e8dff5"
EDGE = "#333333"


def box(ax, x, y, w, h, title, body="", color=GREY, title_size=12, body_size=9.5, dashed=False):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.004,rounding_size=0.012",
                                facecolor=color, edgecolor=EDGE, linewidth=1.4,
                                linestyle="--" if dashed else "-"))
    if body:
        ax.text(x + w / 2, y + h - 0.032, title, ha="center", va="top", fontsize=title_size,
                fontweight="bold")
        ax.text(x + w / 2, y + h - 0.075, body, ha="center", va="top", fontsize=body_size,
                linespacing=1.35)
    else:
        ax.text(x + w / 2, y + h / 2, title, ha="center", va="center", fontsize=title_size,
                fontweight="bold")


def arrow(ax, start, end, label="", both=False, label_dx=0.01, label_ha="left"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="<|-|>" if both else "-|>",
                                 mutation_scale=16, linewidth=1.6, color=EDGE))
    if label:
        ax.text((start[0] + end[0]) / 2 + label_dx, (start[1] + end[1]) / 2, label,
                ha=label_ha, va="center", fontsize=9.5, style="italic")


def draw(out: str) -> None:
    fig = plt.figure(figsize=(12, 7.2), dpi=100)  # 1200 x 720 px
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")

    # the user's side: a recipe and the controller that runs it
    box(ax, 0.03, 0.83, 0.20, 0.13, "recipes/",
        "Hydra CLI: main_ppo, main_sft\nverl's key names", color=GREY)
    box(ax, 0.30, 0.80, 0.67, 0.17, "single controller  (hybridflow/trainer/)",
        "one process runs the RL dataflow as a short loop:\n"
        "generate → reward → old log-prob → ref log-prob → values → advantages\n"
        "→ critic update → actor update → validate / checkpoint / log",
        color=BLUE, title_size=13, body_size=10)
    arrow(ax, (0.23, 0.895), (0.30, 0.895))

    # the controller calls worker groups with DataProto batches
    ax.text(0.43, 0.745, "calls registered methods on worker groups,\n"
            "passes DataProto batches split by data-parallel rank\n(hybridflow/controller/)",
            ha="right", va="center", fontsize=9.5, style="italic", linespacing=1.35)
    for x in (0.47, 0.68, 0.88):
        arrow(ax, (x, 0.80), (x, 0.70), both=True)

    # the actor's worker group: engines, rollout, resharding on the same workers
    ax.add_patch(FancyBboxPatch((0.03, 0.05), 0.555, 0.64,
                                boxstyle="round,pad=0.004,rounding_size=0.015",
                                facecolor="#f7fbff", edgecolor=EDGE, linewidth=1.6))
    ax.text(0.3075, 0.665, "actor + rollout + reference worker group", ha="center", va="center",
            fontsize=12.5, fontweight="bold")
    ax.text(0.3075, 0.625, "Ray actors, one per device slot, each an SPMD rank of one "
            "torch.distributed world", ha="center", va="center", fontsize=9.5)
    box(ax, 0.05, 0.32, 0.25, 0.27, "training engine",
        "workers/engines/\nFSDP2 (shard / replicate / HSDP)\nor Megatron-core TP x PP x DP\n"
        "log-probs, train step, LoRA", color=GREEN)
    box(ax, 0.315, 0.32, 0.25, 0.27, "rollout",
        "workers/rollout/\nvLLM, SPMD in the same workers\n(or transformers' generate)\n"
        "generation TP of its own", color=ORANGE)
    box(ax, 0.05, 0.08, 0.515, 0.17, "3D-HybridEngine  (resharding/)",
        "moves the weights from the training layout (pp, tp, dp)\nto the generation layout (tp, dp) "
        "on the same devices:\neach rank receives only the pieces it lacks",
        color=PURPLE, body_size=9.5)
    arrow(ax, (0.175, 0.32), (0.175, 0.25), both=True, label="train layout")
    arrow(ax, (0.44, 0.25), (0.44, 0.32), label="generation layout")

    # the other roles, each a worker group of its own kind
    box(ax, 0.60, 0.05, 0.17, 0.64, "critic",
        "worker group\n(workers/critic.py)\n\nvalue head on\nFSDP2 or Megatron\n\n"
        "values and the\ncritic update\n(PPO with GAE)", color=GREEN)
    box(ax, 0.795, 0.05, 0.175, 0.64, "reward",
        "reward-model\nworker group\n(workers/reward_model.py)\n\nor a rule / your\n"
        "compute_score, scored\nin a process of\nthe controller's", color=GREY)

    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    fig.savefig(out, dpi=100, facecolor="white")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/images/architecture.png")
    draw(parser.parse_args().out)


if __name__ == "__main__":
    main()
