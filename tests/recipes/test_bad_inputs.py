"""docs/recipes.md's promise for bad input (checks before start-up), through both entry points
(issue 30): every broken data file
or model folder, and a non-finite number in the config, ends before Ray starts with exit 2 and one
line naming the file or key and the fix. Before, these ended in tracebacks (exit 1), passed and
failed in a worker a minute later (a truncated model.safetensors), or were reported as something
else (a folder without tokenizer files as data row 0, an empty file as "filtered to
max_prompt_length"). ``main()`` runs in this process: a case that got past the checks would start
Ray here; the ray_starts fixture refuses that and the test says so."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from recipes import main_ppo, main_sft


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict:
    import pandas as pd

    from hybridflow.data import write_arithmetic_parquet
    from hybridflow.data.arithmetic import ArithmeticTaskConfig
    from hybridflow.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("bad_input_assets")
    model = make_tiny_checkpoint(str(root / "model"), "qwen2", seed=0)
    train, val = write_arithmetic_parquet(str(root / "data"), ArithmeticTaskConfig(train_size=16, val_size=8))
    rows = pd.read_parquet(train)
    sft = str(root / "sft.parquet")
    pd.DataFrame({"prompt": rows["prompt"], "response": [r["ground_truth"] for r in rows["reward_model"]]}
                 ).to_parquet(sft, index=False)
    return {"model": model, "train": train, "val": val, "sft": sft}


def damaged_data(tmp_path, damage: str, good_row: dict) -> str:
    line = json.dumps(good_row).encode()
    path = tmp_path / {"not_utf8": "d.jsonl", "truncated_parquet": "d.parquet", "not_parquet": "d.parquet",
                       "empty": "d.jsonl"}[damage]
    if damage == "not_utf8":
        path.write_bytes(line + b"\n" + line.replace(b"=", b"=\xe9") + b"\n")
    elif damage == "truncated_parquet":
        import pandas as pd

        pd.DataFrame([good_row] * 8).to_parquet(path, index=False)
        path.write_bytes(path.read_bytes()[:-64])
    elif damage == "not_parquet":
        path.write_bytes(line + b"\n")
    else:
        path.write_bytes(b"")
    return str(path)


def damaged_model(tmp_path, model: str, damage: str) -> str:
    folder = tmp_path / "model"
    shutil.copytree(model, folder)
    if damage in ("config_json", "tokenizer_config_json"):
        (folder / damage.replace("_json", ".json")).write_text('{"model_type": "qwen2", "hidden')
    elif damage == "truncated_safetensors":
        shard = folder / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:-1000])
    else:  # no tokenizer files
        os.remove(folder / "tokenizer.json")
        os.remove(folder / "tokenizer_config.json")
    return str(folder)


DATA_CASES = {  # damage: what the one line must say
    "not_utf8": "d.jsonl: line 2 is not UTF-8 text (byte 0xe9 at column",
    "truncated_parquet": "d.parquet is not a readable parquet file (Parquet magic bytes not found",
    "not_parquet": "d.parquet is not a readable parquet file",
    "empty": "d.jsonl is empty (0 bytes): write its rows, or remove it from data.train_files",
}
MODEL_CASES = {
    "config_json": "/model/config.json is not valid JSON (line 1 column 25: Unterminated string",
    "tokenizer_config_json": "/model/tokenizer_config.json is not valid JSON (line 1 column 25",
    "truncated_safetensors": "/model/model.safetensors is truncated: ",
    "no_tokenizer": "/model has no tokenizer (none of tokenizer.json, tokenizer.model, vocab.json",
}


def ppo_args(assets, tmp_path, **replace) -> list[str]:
    keys = {"data.train_files": f"[{assets['train']}]", "data.val_files": f"[{assets['val']}]",
            "actor_rollout_ref.model.path": assets["model"], "trainer.n_gpus_per_node": "2",
            "data.train_batch_size": "4", "actor_rollout_ref.actor.ppo_mini_batch_size": "2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": "2", "custom_reward_function.path": "null",
            "trainer.default_local_dir": str(tmp_path / "run"), **replace}
    return ["--config-name", "grpo", *(f"{k}={v}" for k, v in keys.items())]


def sft_args(assets, tmp_path, **replace) -> list[str]:
    keys = {"data.train_files": f"[{assets['sft']}]", "data.val_files": f"[{assets['sft']}]",
            "model.path": assets["model"], "trainer.n_gpus_per_node": "2", "data.train_batch_size": "8",
            "data.micro_batch_size_per_gpu": "2", "trainer.default_local_dir": str(tmp_path / "run"), **replace}
    return [f"{k}={v}" for k, v in keys.items()]


def one_line_exit_2(main, argv, capsys, tmp_path, label: str, text: str, ray_starts: list) -> None:
    code = main(argv)
    err = capsys.readouterr().err
    assert not ray_starts, "Ray started before the input was checked"
    ours = [line for line in err.splitlines() if line.startswith(f"{label}:")]
    assert code == 2, f"exit {code}\n{err[-3000:]}"
    assert len(ours) == 1 and text in ours[0], err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not os.path.exists(tmp_path / "run")


PPO_ROW = {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "1+1="}],
           "reward_model": {"ground_truth": "2"}}
SFT_ROW = {"prompt": "1+1=", "response": "2"}


@pytest.mark.parametrize("damage", DATA_CASES)
def test_ppo_bad_data_file(assets, tmp_path, capsys, ray_starts, damage):
    path = damaged_data(tmp_path, damage, PPO_ROW)
    one_line_exit_2(main_ppo.main, ppo_args(assets, tmp_path, **{"data.train_files": f"[{path}]"}), capsys,
                    tmp_path, "data error", DATA_CASES[damage], ray_starts)


@pytest.mark.parametrize("damage", DATA_CASES)
def test_sft_bad_data_file(assets, tmp_path, capsys, ray_starts, damage):
    path = damaged_data(tmp_path, damage, SFT_ROW)
    one_line_exit_2(main_sft.main, sft_args(assets, tmp_path, **{"data.train_files": f"[{path}]"}), capsys,
                    tmp_path, "data error", DATA_CASES[damage], ray_starts)


@pytest.mark.parametrize("damage", MODEL_CASES)
def test_ppo_bad_model_folder(assets, tmp_path, capsys, ray_starts, damage):
    folder = damaged_model(tmp_path, assets["model"], damage)
    argv = ppo_args(assets, tmp_path, **{"actor_rollout_ref.model.path": folder})
    one_line_exit_2(main_ppo.main, argv, capsys, tmp_path, "config error",
                    "actor_rollout_ref.model.path: " + str(tmp_path) + MODEL_CASES[damage], ray_starts)


@pytest.mark.parametrize("damage", MODEL_CASES)
def test_sft_bad_model_folder(assets, tmp_path, capsys, ray_starts, damage):
    folder = damaged_model(tmp_path, assets["model"], damage)
    one_line_exit_2(main_sft.main, sft_args(assets, tmp_path, **{"model.path": folder}), capsys, tmp_path,
                    "config error", "model.path: " + str(tmp_path) + MODEL_CASES[damage], ray_starts)


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_non_finite_learning_rate_is_refused_by_both(assets, tmp_path, capsys, ray_starts, value):
    argv = ppo_args(assets, tmp_path, **{"actor_rollout_ref.actor.optim.lr": value})
    one_line_exit_2(main_ppo.main, argv, capsys, tmp_path, "config error",
                    f"actor_rollout_ref.actor.optim.lr={value} must be a finite number, not inf or nan", ray_starts)
    one_line_exit_2(main_sft.main, sft_args(assets, tmp_path, **{"optim.lr": value}), capsys, tmp_path,
                    "config error", f"optim.lr={value} must be a finite number, not inf or nan", ray_starts)


def weightless(tmp_path, model: str, name: str = "weightless", **config) -> str:
    """A copy of ``model`` without its weight file (config.json and the tokenizer stay): validate()
    passes it, and before, the run failed a minute later in a worker."""
    folder = tmp_path / name
    shutil.copytree(model, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    if config:
        (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()),
                                                        **config}))
    return str(folder)


NO_WEIGHTS = "has no weights (no *.safetensors, pytorch_model*.bin file): point {key} at an HF model folder"
RM_CONFIG = {"architectures": ["Qwen2ForSequenceClassification"], "num_labels": 1, "id2label": {"0": "LABEL_0"}}


@pytest.mark.parametrize("key", ["actor_rollout_ref.model.path", "critic.model.path", "reward_model.model.path"])
def test_ppo_model_folder_without_weights(assets, tmp_path, capsys, ray_starts, key):
    folder = weightless(tmp_path, assets["model"], **(RM_CONFIG if key.startswith("reward") else {}))
    extra = {"reward_model.enable": "true"} if key.startswith("reward") else {}
    argv = ppo_args(assets, tmp_path, **{key: folder}, **extra)
    if key.startswith("critic"):
        argv[1] = "ppo"  # a run that trains a critic
    one_line_exit_2(main_ppo.main, argv, capsys, tmp_path, "config error",
                    f"{key}: {folder} " + NO_WEIGHTS.format(key=key), ray_starts)


def test_sft_model_folder_without_weights(assets, tmp_path, capsys, ray_starts):
    folder = weightless(tmp_path, assets["model"])
    one_line_exit_2(main_sft.main, sft_args(assets, tmp_path, **{"model.path": folder}), capsys, tmp_path,
                    "config error", f"model.path: {folder} " + NO_WEIGHTS.format(key="model.path"), ray_starts)


def test_a_checkpoints_model_metadata_is_not_a_model_path(assets, tmp_path, capsys, ray_starts):
    """global_step_N/actor/huggingface holds config.json and the tokenizer of an FSDP or Megatron
    checkpoint, not its weights: the line says how to export them."""
    step = tmp_path / "ckpt" / "global_step_2"
    folder = weightless(step / "actor", assets["model"], name="huggingface")
    (step / "actor" / "engine.json").write_text("{}")
    key = "actor_rollout_ref.model.path"
    one_line_exit_2(main_ppo.main, ppo_args(assets, tmp_path, **{key: folder}), capsys, tmp_path, "config error",
                    f"{key}: {folder} has no weights (no *.safetensors, pytorch_model*.bin file): it belongs to a "
                    f"training checkpoint ({step / 'actor'}), not a model: export one with python "
                    f"scripts/export_hf.py {step / 'actor'} <out_dir> and set {key}=<out_dir>", ray_starts)
