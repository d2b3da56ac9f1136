"""The tool recipe's config on a fresh clone: it validates as shipped, and where its demo assets are
missing the error says which command builds them (before Ray starts)."""
import pytest

from hybridflow.config.errors import ConfigError
from recipes import main_ppo


def test_missing_tool_demo_assets_name_the_command_that_builds_them(ray_starts, tmp_path):
    with pytest.raises(ConfigError) as err:
        main_ppo.load_and_validate([
            "--config-name", "grpo_tools", "data.train_files=[data/tool_arithmetic/missing.parquet]",
            "data.val_files=[data/tool_arithmetic/missing-val.parquet]",  # whether or not the demo ran here
            "actor_rollout_ref.model.path=data/models/tiny-llama-chat-missing",
            f"trainer.default_local_dir={tmp_path}"])
    message = str(err.value)
    assert all(key in message for key in ("data.train_files[0]", "data.val_files[0]", "actor_rollout_ref.model.path"))
    assert message.count("`python -m recipes.demo_tools` builds") == 3, message
    assert not ray_starts


def test_grpo_tools_turns_on_the_tool_agent_with_the_calculator():
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=f"{main_ppo.__file__.rsplit('/', 1)[0]}/config", version_base=None):
        cfg = compose(config_name="grpo_tools")
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.tool_config_path == "recipes/config/tools/calculator.yaml"
    from hybridflow.agent.tools.config import load_tools

    assert list(load_tools(mt.tool_config_path)) == ["calc"]
