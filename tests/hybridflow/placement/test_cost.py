"""Memory arithmetic on hand-checked cases, and the cost model's direction of effects."""
import dataclasses

import pytest

from hybridflow.placement.cost import Coster, memory, role_params
from hybridflow.placement.devices import H100_SXM, Cluster
from hybridflow.placement.plans import Plan, Pool, RoleLayout
from hybridflow.placement.workload import CATALOG, Workload

P7 = 6_738_415_616
W7 = Workload(actor=CATALOG["llama-2-7b"], reference=False, micro_batch=2, prompt_len=1024, response_len=1024)
ONE_NODE = Cluster(1, 8, H100_SXM)


def _plan(layout, rollout=RoleLayout(1, 1, 8, 1, "vllm")):
    return Plan((Pool("main", 8, ("actor",)),), {"actor": layout}, rollout)


def test_adam_mixed_precision_is_16_bytes_per_parameter_before_sharding():
    m = memory(W7, ONE_NODE, _plan(RoleLayout(1, 1, 8, 1, "fsdp")), "actor")
    assert m["weights"] + m["grads"] + m["optimizer"] == 16 * P7
    sharded = memory(W7, ONE_NODE, _plan(RoleLayout(1, 1, 8, 8, "fsdp")), "actor")
    assert sharded["weights"] + sharded["grads"] + sharded["optimizer"] == pytest.approx(16 * P7 / 8)


def test_megatron_distributed_optimizer_is_6_plus_12_over_dp_bytes_per_parameter():
    # tp2 x dp4: bf16 weights + fp32 grads (6 bytes) split by tp, fp32 master + moments (12) by tp and dp
    m = memory(W7, ONE_NODE, _plan(RoleLayout(2, 1, 4, 4, "megatron")), "actor")
    assert m["weights"] + m["grads"] == pytest.approx(6 * P7 / 2)
    assert m["optimizer"] == pytest.approx(12 * P7 / 2 / 4)


def test_kv_cache_of_a_7b_sequence_is_one_gib_at_2048_tokens():
    # 2 (K,V) x 32 layers x 4096 x 2 bytes = 512 KiB a token; 2048 tokens = 1 GiB; tp2 halves it
    k = Coster(W7, ONE_NODE)
    assert k.kv_per_seq(1) == 2 ** 30
    assert k.kv_per_seq(2) == 2 ** 29
    m = memory(W7, ONE_NODE, _plan(RoleLayout(1, 1, 8, 8, "fsdp"), RoleLayout(2, 1, 4, 1, "vllm")), "rollout")
    assert m["kv_cache"] == 1024 // 4 * 2 ** 29  # all 256 sequences of a replica at full length
    assert m["weights"] == P7 * 2 / 2


def test_layer_activations_and_recompute():
    k = Coster(W7, ONE_NODE)
    # 2 sequences x 2048 tokens x (12 h + 4 kv + 8 ffn) bytes = 629,145,600 bytes a layer at tp1
    assert k.layer_act_bytes("actor", 2, 1) == 2 * 2048 * (12 * 4096 + 4 * 4096 + 8 * 11008)
    full = k.activation_bytes("actor", RoleLayout(1, 1, 8, 1, "fsdp"), trained=True)
    no_rc = Coster(Workload(actor=W7.actor, reference=False, recompute=False), ONE_NODE)
    assert no_rc.activation_bytes("actor", RoleLayout(1, 1, 8, 1, "fsdp"), trained=True) > 5 * full


def test_value_head_roles_drop_the_lm_head():
    w = Workload(actor=CATALOG["llama-2-7b"], critic=CATALOG["llama-2-7b"])
    assert role_params(w, "actor") - role_params(w, "critic") == 32000 * 4096 - 4096


def test_tensor_parallel_decode_is_faster_but_not_linear_and_matching_layouts_need_no_resharding():
    k = Coster(W7, ONE_NODE)
    pool = Pool("main", 8, ("actor",))
    t1, _ = k.generate_s(RoleLayout(1, 1, 1, 1, "vllm"), 2e12, pool)
    t2, _ = k.generate_s(RoleLayout(2, 1, 1, 1, "vllm"), 2e12, pool)
    # the whole batch fits either way: half the bytes per device, plus all-reduces and per-step overhead
    assert t1 / 2 < t2 < t1
    same = k.reshard_s(RoleLayout(8, 1, 1, 1, "megatron"), RoleLayout(8, 1, 1, 1, "vllm"), pool)
    gather = k.reshard_s(RoleLayout(8, 1, 1, 1, "megatron"), RoleLayout(2, 1, 4, 1, "vllm"), pool)
    assert same == 0.0 < gather


def test_generation_batch_is_capped_by_free_kv_memory():
    k = Coster(W7, ONE_NODE)
    pool = Pool("main", 8, ("actor",))
    _, batch = k.generate_s(RoleLayout(1, 1, 8, 1, "vllm"), 10 * 2 ** 30, pool)
    assert batch == 10  # 10 GiB free, 1 GiB per full-length sequence: 10 at a time, 128 in 13 waves


def test_a_calibrated_profile_uses_its_measured_rates():
    dev = dataclasses.replace(H100_SXM, measured={"fwd_flops": {"bf16": 1e12}, "train_flops": {"bf16": 5e11},
                                                  "decode_flops": {"bf16": 2e12}, "decode_step_s": 0.01})
    w = Workload(actor=CATALOG["llama-2-7b"], reference=False, prompts=4, prompt_len=8, response_len=8)
    k = Coster(w, Cluster(1, 1, dev))
    one = Pool("main", 1, ("actor",))
    lay = RoleLayout(1, 1, 1, 1, "fsdp")
    assert k.forward_s("actor", lay, one) == pytest.approx(4 * 16 * 2 * P7 / 1e12)
    assert k.train_s("actor", lay, one) == pytest.approx(4 * 16 * 6 * P7 / 5e11)
    gen, batch = k.generate_s(RoleLayout(1, 1, 1, 1, "vllm"), 1e12, one)
    assert batch == 4
    assert gen == pytest.approx(4 * 8 * 2 * P7 / 1e12 + 8 * (0.01 + 4 * 2 * P7 / 2e12))
