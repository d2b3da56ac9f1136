"""``--help`` lists every key of a recipe's tree with its default, doc and range, read from the
fields; the base config Hydra composes from is the same tree."""
from hybridflow.config import RootConfig, dotted_keys
from hybridflow.config.sft import SFTConfig
from recipes.cli import cli_info, key_help


def test_help_lists_a_key_with_its_default_doc_and_range():
    text = cli_info(["--help"], "ppo", "usage")
    lines = text.splitlines()
    section = lines.index("actor_rollout_ref.rollout:")
    n_line = next(line for line in lines[section:] if line.startswith("  n="))
    assert n_line == "  n=1  responses sampled per prompt  [a positive integer]"
    assert "configs (--config-name):" in text and "grpo" in text


def test_help_has_one_line_per_key_of_each_tree():
    for schema in (RootConfig, SFTConfig):
        text = key_help(schema)
        leaves = [k for k in dotted_keys(schema) if k + ":" not in text.splitlines()]
        assert len([line for line in text.splitlines() if line.startswith("  ")]) == len(leaves)
    assert "  default_local_dir=checkpoints/${trainer.project_name}/${trainer.experiment_name}  " in key_help(RootConfig)
