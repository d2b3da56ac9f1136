"""fsdp_config.fsdp_size=auto: replicated on a CPU host where every role's replicas fit in a
quarter of memory, sharded otherwise, on a GPU, with offload, or when a size cannot be read."""
import json

import pytest
from safetensors import safe_open

from hybridflow import auto_fsdp_size
from hybridflow.config import load_config, validate
from hybridflow.config.resolve import say_once
from hybridflow.config.sft import load_sft_config
from hybridflow.tiny import make_tiny_checkpoint

GIB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny") / "model"), "qwen2", tied=True)


def rl(model, *, memory=24 * GIB, monkeypatch=None, **sections):
    """load_config on CPU with 2 workers and the host's memory set to ``memory``."""
    monkeypatch.setattr(auto_fsdp_size, "host_memory_bytes", lambda: memory)
    cfg = {"actor_rollout_ref": {"model": {"path": model}}, "trainer": {"device": "cpu", "n_gpus_per_node": 2}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return load_config(cfg)


def model_config(path):
    with open(f"{path}/config.json") as f:
        return json.load(f)


def sizes(cfg):
    arr = cfg.actor_rollout_ref
    return arr.actor.fsdp_config.fsdp_size, arr.ref.fsdp_config.fsdp_size, cfg.critic.model.fsdp_config.fsdp_size


def test_the_parameter_count_is_read_from_the_safetensors_headers(tiny, tmp_path):
    with safe_open(f"{tiny}/model.safetensors", "pt") as f:
        expected = sum(f.get_tensor(name).numel() for name in f.keys())
    assert auto_fsdp_size.checkpoint_parameter_count(tiny) == expected > 0
    assert auto_fsdp_size.checkpoint_parameter_count(str(tmp_path)) is None  # no weights
    assert auto_fsdp_size.checkpoint_parameter_count(str(tmp_path / "missing")) is None
    (tmp_path / "broken.safetensors").write_bytes(b"\x05")
    assert auto_fsdp_size.checkpoint_parameter_count(str(tmp_path)) is None


def test_the_rule_counts_each_role_on_each_worker_against_a_quarter_of_memory():
    trained = auto_fsdp_size.replica_bytes(1000, trained=True, lora=False)
    assert trained == 16_000 and auto_fsdp_size.replica_bytes(1000, trained=True, lora=True) == 4000
    roles = [("actor", trained, 2), ("reference", 4000, 2)]  # 40 kB per host
    assert auto_fsdp_size.choose(roles, on_gpu=False, memory=160_000)[0] == 1
    assert auto_fsdp_size.choose(roles, on_gpu=False, memory=159_999)[0] == -1
    assert auto_fsdp_size.choose(roles, on_gpu=True, memory=10**12)[0] == -1
    size, why = auto_fsdp_size.choose([("critic", None, 2)], on_gpu=False, memory=10**12)
    assert size == -1 and "critic" in why


def test_a_small_model_on_cpu_replicates_every_role_and_says_so(tiny, monkeypatch, capsys):
    say_once.cache_clear()
    cfg = rl(tiny, monkeypatch=monkeypatch, algorithm={"adv_estimator": "gae"})
    assert sizes(cfg) == (1, 1, 1)
    validate(cfg, check_paths=False, model_config=model_config(tiny))  # the demo data may not exist yet
    assert "fsdp_size=auto -> 1 (replicated, DDP)" in capsys.readouterr().err


def test_a_host_too_small_for_the_replicas_shards_them(tiny, monkeypatch):
    count = auto_fsdp_size.checkpoint_parameter_count(tiny)
    # PPO: 2 workers, each with a trained actor and a trained critic (no reference without KL)
    need = 2 * 2 * auto_fsdp_size.replica_bytes(count, True, False)
    ppo = {"adv_estimator": "gae"}
    assert sizes(rl(tiny, memory=4 * need, monkeypatch=monkeypatch, algorithm=ppo)) == (1, 1, 1)
    assert sizes(rl(tiny, memory=4 * need - 4, monkeypatch=monkeypatch, algorithm=ppo)) == (-1, -1, -1)


def test_what_the_user_sets_is_kept_and_megatron_gets_minus_one(tiny, monkeypatch):
    cfg = rl(tiny, monkeypatch=monkeypatch, algorithm={"adv_estimator": "gae"},
             critic={"model": {"fsdp_config": {"fsdp_size": -1}}})
    assert sizes(cfg) == (1, 1, -1)
    cfg = rl(tiny, monkeypatch=monkeypatch, algorithm={"adv_estimator": "gae"},
             actor_rollout_ref={"model": {"path": tiny}, "actor": {"strategy": "megatron"}})
    assert sizes(cfg) == (-1, -1, 1)  # the fsdp critic still decides for itself


def test_offload_unknown_sizes_and_a_single_worker_shard(tiny, monkeypatch, tmp_path):
    offload = {"model": {"path": tiny}, "actor": {"fsdp_config": {"param_offload": True}}}
    cfg = rl(tiny, monkeypatch=monkeypatch, actor_rollout_ref=offload)
    assert sizes(cfg)[:2] == (-1, -1)
    validate(cfg, check_paths=False, model_config=model_config(tiny))  # replicated + param_offload is refused
    assert sizes(rl(str(tmp_path), monkeypatch=monkeypatch))[0] == -1  # no safetensors to count
    one = rl(tiny, monkeypatch=monkeypatch, trainer={"device": "cpu", "n_gpus_per_node": 1})
    assert sizes(one)[0] == -1


def test_sft_resolves_its_model_too(tiny, monkeypatch):
    monkeypatch.setattr(auto_fsdp_size, "host_memory_bytes", lambda: 24 * GIB)
    cfg = load_sft_config({"model": {"path": tiny}, "trainer": {"device": "cpu", "n_gpus_per_node": 2}})
    assert cfg.model.fsdp_config.fsdp_size == 1


def test_a_size_that_is_neither_a_number_nor_auto_is_named(tiny, monkeypatch):
    cfg = rl(tiny, monkeypatch=monkeypatch, actor_rollout_ref={"model": {"path": tiny},
                                                               "actor": {"fsdp_config": {"fsdp_size": "half"}}})
    with pytest.raises(ValueError, match=r"fsdp_size='half' is not a size: use auto, -1"):
        validate(cfg)
