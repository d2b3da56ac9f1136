"""`python -m recipes.demo_tools`: multi-turn, tool-using GRPO on CPU (issue 37), end to end.

1. Build what is missing under ``data/``: the calculator task (``hybridflow/data/tool_arithmetic.py``:
   ``a*b+c`` with 3-digit operands; RL rows with ``agent_name: tool_agent``, multi-turn SFT traces)
   and a tiny Llama-style model with the chat tokenizer of ``hybridflow/tiny_chat.py`` (Llama,
   not Qwen2: transformers' AutoTokenizer reads the saved tokenizer of a Llama folder as saved).
2. Warm-start it with the multi-turn SFT recipe on the traces (half call the calculator, half
   answer directly), stopped early on purpose so greedy accuracy starts low.
3. Run the ``grpo_tools`` recipe: each trajectory generates, calls the calculator, reads its answer
   and replies; GRPO learns to call the tool and to copy right. Prints val/score/mean before and after.

Every step goes through the public entry points (``recipes.main_sft``, ``recipes.main_ppo``).
Extra ``key=value`` arguments are passed to the GRPO run.
"""
from __future__ import annotations

import json
import os
import sys
import time

from recipes.demo import shard_bar_hidden

DATA = "data/tool_arithmetic"
INIT_MODEL = "data/models/tiny-llama-chat-init"
SFT_MODEL = "data/models/tiny-llama-chat-sft"
OUT = "runs/demo-tools"
BUILD_COMMAND = "python -m recipes.demo_tools"

TASK = dict(digits=3, train_size=2048, val_size=128, tool_fraction=0.5, seed=0)
MODEL = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, tied=True, seed=0)
SFT_OVERRIDES = [
    f"data.train_files=[{DATA}/sft_train.parquet]", f"data.val_files=[{DATA}/sft_val.parquet]",
    "data.multiturn.enable=true", "data.multiturn.messages_key=messages",
    f"model.path={INIT_MODEL}", f"trainer.hf_output_dir={SFT_MODEL}", "trainer.default_local_dir=runs/demo-tools-sft",
    "data.max_length=160", "data.train_batch_size=64", "data.micro_batch_size_per_gpu=32",
    "optim.lr=2e-3", "optim.weight_decay=0.0", "trainer.total_epochs=100", "trainer.total_training_steps=150",
    "trainer.n_gpus_per_node=2", "model.param_dtype=fp32",
]


def build_assets() -> None:
    """Write the task files and the initial model if they are not there yet (seeded: same bytes every time)."""
    from hybridflow.data.tool_arithmetic import ToolArithmeticConfig, write_tool_arithmetic
    from hybridflow.tiny_chat import make_tiny_chat_checkpoint

    if not os.path.exists(f"{DATA}/sft_val.parquet"):
        write_tool_arithmetic(DATA, ToolArithmeticConfig(**TASK))
        print(f"demo_tools: wrote the calculator task to {DATA}/")
    if not os.path.exists(f"{INIT_MODEL}/config.json"):
        with shard_bar_hidden():
            make_tiny_chat_checkpoint(INIT_MODEL, "llama", **MODEL)
        print(f"demo_tools: wrote the initial model to {INIT_MODEL}/")


def warm_start(extra: list[str] = ()) -> None:
    from recipes import main_sft

    print("demo_tools: SFT warm start on tool-use traces")
    main_sft.run(main_sft.load_and_validate([*SFT_OVERRIDES, *extra]))
    import ray

    ray.shutdown()


def main(argv=None) -> int:
    from recipes import main_ppo

    argv = sys.argv[1:] if argv is None else argv
    start = time.time()
    build_assets()
    if not os.path.exists(f"{SFT_MODEL}/config.json"):
        warm_start()
    print("demo_tools: GRPO with the calculator")
    cfg = main_ppo.load_and_validate(["--config-name", "grpo_tools", f"trainer.default_local_dir={OUT}", *argv])
    summary = main_ppo.run(cfg)
    val = [(h["step"], h["val/score/mean"]) for h in summary["history"] if "val/score/mean" in h]
    first, last = val[0][1], val[-1][1]
    agent = {k: v for k, v in summary["history"][-1].items() if k.startswith("agent/")}
    print(json.dumps({"val/score/mean": {"step_0": first, f"step_{val[-1][0]}": last, "gain": last - first},
                      "minutes": round((time.time() - start) / 60, 2), "last_step_agent_metrics": agent,
                      "hf_checkpoint": summary["hf_dir"], "reward_curve": summary["plot"],
                      "metrics": os.path.join(cfg.trainer.default_local_dir, "metrics.jsonl"),
                      "logs": summary["logs"]}, indent=2))
    return 0


if __name__ == "__main__":
    from recipes.process_exit import exit_process

    exit_process(main())
