"""Device profiles (data, each with its source) and the cluster the planner places onto.

Peak numbers are the vendor's dense (non-sparse) figures; the cost model (cost.py) applies its own
named efficiency factors to them, so a profile stays a plain copy of a datasheet. Bandwidths are
bytes/s per device in one direction: ``intra_node_bw`` over NVLink/NVSwitch to a device in the same
node, ``inter_node_bw`` the share of the node's network one device gets when all of them talk
across nodes at once (the case of every collective that spans nodes).
``calibrate.py`` builds a profile of the machine in hand with the same fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GB = 1e9
GiB = 2 ** 30


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    flops: dict  # dtype name ("bf16", "fp16", "fp32", "tf32", "fp8") -> peak dense FLOP/s
    mem_bytes: float  # device memory, bytes
    mem_bw: float  # device memory bandwidth, bytes/s
    intra_node_bw: float  # per device, one direction, bytes/s
    inter_node_bw: float  # per device, one direction, bytes/s
    source: str = ""
    # Achieved rates of the machine in hand (calibrate.py), which the cost model prefers to peak x
    # efficiency: fwd_flops / train_flops / decode_flops {dtype: FLOP/s of 2N, 6N, 2N a token},
    # decode_step_s (fixed seconds a decode step), collective_latency_s. Empty for datasheets.
    measured: dict = field(default_factory=dict, compare=False, hash=False)

    def flops_for(self, dtype: str) -> float:
        if dtype in self.flops:
            return self.flops[dtype]
        if dtype == "fp16" and "bf16" in self.flops:
            return self.flops["bf16"]
        raise KeyError(f"{self.name} has no {dtype} throughput (has {sorted(self.flops)})")


# NVIDIA H100 SXM5 80GB. Datasheet ("NVIDIA H100 Tensor Core GPU", nvidia.com/en-us/data-center/h100,
# H100 SXM column): BF16/FP16 tensor 1,979 TFLOPS *with sparsity* -> 989.4 dense; TF32 494.7 dense;
# FP32 67; FP8 1,979 dense; 80 GB HBM3 at 3.35 TB/s; NVLink 900 GB/s (both directions) -> 450 GB/s
# one way. Network: DGX H100 (DGX H100 datasheet/user guide) has 8 ConnectX-7 400 Gb/s InfiniBand
# ports, one per GPU -> 50 GB/s per device one way.
H100_SXM = DeviceProfile(
    name="h100", flops={"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 67e12, "fp8": 1979e12},
    mem_bytes=80 * GB, mem_bw=3.35e12, intra_node_bw=450 * GB, inter_node_bw=50 * GB,
    source="NVIDIA H100 Tensor Core GPU datasheet (SXM5, dense figures); DGX H100: 8x ConnectX-7 400 Gb/s")

# NVIDIA A100 SXM4 80GB. Datasheet ("NVIDIA A100 Tensor Core GPU", nvidia.com/en-us/data-center/a100):
# BF16/FP16 tensor 312 TFLOPS dense; TF32 156; FP32 19.5; 80 GB HBM2e at 2,039 GB/s; NVLink 600 GB/s
# (both directions) -> 300 GB/s one way. DGX A100 (datasheet): 8 ConnectX-6 200 Gb/s HDR ports for
# compute, one per GPU -> 25 GB/s per device one way.
A100_SXM = DeviceProfile(
    name="a100", flops={"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    mem_bytes=80 * GB, mem_bw=2.039e12, intra_node_bw=300 * GB, inter_node_bw=25 * GB,
    source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB); DGX A100: 8x ConnectX-6 200 Gb/s HDR")

# The HybridFlow paper's testbed (section 8.1): 16 machines of 8 A100-80GB, 600 GB/s NVLink, and
# "inter-machine bandwidth 200 Gbps" -- one 200 Gb/s link per machine, shared by its 8 GPUs
# (25 GB/s / 8 = 3.125 GB/s per device). Used to compare the planner with the paper's choices.
A100_PAPER = DeviceProfile(
    name="a100-hybridflow", flops=dict(A100_SXM.flops), mem_bytes=A100_SXM.mem_bytes, mem_bw=A100_SXM.mem_bw,
    intra_node_bw=300 * GB, inter_node_bw=25 * GB / 8,
    source="HybridFlow (arXiv:2409.19256) section 8.1 testbed: A100-80GB, 600 GB/s NVLink, 200 Gbps per machine")

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (H100_SXM, A100_SXM, A100_PAPER)}


def device_by_name(name: str) -> DeviceProfile:
    if name.lower() not in PROFILES:
        raise KeyError(f"unknown device {name!r}: one of {sorted(PROFILES)}")
    return PROFILES[name.lower()]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``slots_per_node`` identical devices (a slot is a GPU, or a CPU worker here)."""

    nodes: int
    slots_per_node: int
    device: DeviceProfile

    @property
    def slots(self) -> int:
        return self.nodes * self.slots_per_node

    def link_bw(self, group: int, stride: int = 1) -> float:
        """Per-device bandwidth of a collective over ``group`` devices placed ``stride`` apart.

        Megatron's convention puts TP innermost (stride 1), so a group stays within a node while
        ``group * stride <= slots_per_node``; past that, the ring crosses the network and runs at its pace.
        """
        if group <= 1:
            return float("inf")
        if group * stride <= self.slots_per_node:
            return self.device.intra_node_bw
        return self.device.inter_node_bw
