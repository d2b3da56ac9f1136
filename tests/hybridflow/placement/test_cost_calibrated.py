"""A calibrated CPU profile in the cost model (hybridflow/placement/cost.py): each role computes at the
measured rate of its own dtype (the runtime's reward model is fp32 beside a bf16 actor), and FSDP's
all-gathers and gradient reduce-scatters run at gloo's measured rates for those collectives."""
import pytest

from hybridflow.placement.calibrate import CPU_CONSTANTS
from hybridflow.placement.cost import DEFAULT, Coster, role_params, with_overrides
from hybridflow.placement.devices import Cluster, DeviceProfile
from hybridflow.placement.plans import Pool, RoleLayout
from hybridflow.placement.workload import ModelShape, Workload

SHAPE = ModelShape("m", 512, 8, 8, 4, 1536, 128, tied=True)
MEASURED = {"fwd_flops": {"fp32": 1e11, "bf16": 4e11}, "train_flops": {"bf16": 3e11},
            "decode_flops": {"bf16": 2e11}, "decode_step_s_by_dtype": {"bf16": 5e-3}, "collective_latency_s": 2e-4,
            "all_reduce_bw": 1.8e9, "all_gather_bw": 0.6e9, "reduce_scatter_bw": 0.5e9}
CPU = DeviceProfile("cpu", {"fp32": 1.1e11, "bf16": 5e11}, 12e9, 4e10, 1.8e9, 1.8e9, "test", MEASURED)


def coster(**extra):
    w = Workload(actor=SHAPE, critic=SHAPE, reward_model=SHAPE, prompts=32, samples_per_prompt=4, prompt_len=16,
                 response_len=16, micro_batch=64, recompute=False, extra=extra)
    # calibrate.CPU_CONSTANTS: a 1-thread worker hides no traffic under compute
    return Coster(w, Cluster(1, 2, CPU), with_overrides(DEFAULT, CPU_CONSTANTS))


def test_a_role_computes_at_its_own_dtypes_rate():
    pool, lay = Pool("main", 2, ("actor", "reward_model")), RoleLayout(1, 1, 2, 1, "fsdp")
    bf16, fp32 = coster(), coster(role_bytes={"reward_model": 4})
    assert fp32.forward_s("reward_model", lay, pool) == pytest.approx(4 * bf16.forward_s("reward_model", lay, pool))
    assert fp32.forward_s("actor", lay, pool) == bf16.forward_s("actor", lay, pool)
    # its weights are held in fp32 too
    weights = lambda k: k.state_bytes("reward_model", lay, False)["weights"]  # noqa: E731
    assert weights(fp32) == 2 * weights(bf16)


def test_sharded_fsdp_pays_the_measured_gather_and_scatter_rates():
    k = coster()
    pool = Pool("main", 2, ("actor",))
    rep, shard = RoleLayout(1, 1, 2, 1, "fsdp"), RoleLayout(1, 1, 2, 2, "fsdp")
    p = role_params(k.w, "actor")
    lat = MEASURED["collective_latency_s"]
    # replicated: one fp32 gradient all-reduce (2 (g-1)/g = 1x moved at g = 2)
    ddp = lat + p * 4 / MEASURED["all_reduce_bw"]
    # sharded, one micro-batch: bf16 parameters gathered twice, fp32 gradients reduce-scattered ((g-1)/g = 1/2)
    fsdp = 2 * (lat + p * 2 / 2 / MEASURED["all_gather_bw"]) + lat + p * 4 / 2 / MEASURED["reduce_scatter_bw"]
    assert k.train_s("actor", shard, pool) - k.train_s("actor", rep, pool) == pytest.approx(fsdp - ddp, rel=1e-6)
