"""Shared by the config-check tests: a run directory with the demo's default files, the grpo recipe's
tiny shape with overrides, and the one-line error a config gets."""
import json

import pytest

from hybridflow.config import ConfigError, load_config, validate

TINY_MODEL = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 66, "intermediate_size": 256, "num_hidden_layers": 2,
              "hidden_size": 128, "max_position_embeddings": 512}


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A working directory holding the demo's default files (contents do not matter here)."""
    (tmp_path / "data/arithmetic").mkdir(parents=True)
    for split in ("train", "val"):
        (tmp_path / f"data/arithmetic/{split}.parquet").write_bytes(b"")
    model = tmp_path / "data/models/tiny-qwen2-sft"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps(TINY_MODEL))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def grpo(**overrides):
    """The grpo recipe's tiny shape as a dict, with dotted-key overrides."""
    tree = {"algorithm": {"adv_estimator": "grpo"},
            "data": {"train_batch_size": 8},
            "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 8,
                                            "use_kl_loss": True},
                                  "rollout": {"n": 4}},
            "trainer": {"n_gpus_per_node": 2}}
    for dotted, value in overrides.items():
        node, *path, leaf = dotted.split("__")
        cur = tree.setdefault(node, {})
        for part in path:
            cur = cur.setdefault(part, {})
        cur[leaf] = value
    return load_config(tree)


def error_of(cfg, **kwargs) -> str:
    with pytest.raises(ConfigError) as err:
        validate(cfg, **kwargs)
    msg = str(err.value)
    assert "\n" not in msg
    return msg
