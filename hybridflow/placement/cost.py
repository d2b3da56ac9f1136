"""The cost model: seconds per stage and bytes per device for one role in one layout.

Compute is FLOPs over the device's peak times a named efficiency; communication is bytes over a
link's bandwidth (ring collectives, NCCL's algorithms) plus a latency; memory is counted per
device from the parameter count, the layout's sharding and the batch. Every constant below is a
field of ``Constants`` with its reason; ``plan_all(calibration=...)`` may override any of them
(a calibrated device measures achieved, not peak, throughput, so its efficiencies are 1).

Conventions: P parameters, b = ``workload.param_bytes`` (bf16: 2); "per device" is one rank of the
role's layout; tokens of a role's stage are split over its dp ranks; a layer's weights over tp,
the layers over pp.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hybridflow.placement.devices import Cluster
from hybridflow.placement.plans import Pool, RoleLayout
from hybridflow.placement.workload import Workload


@dataclass(frozen=True)
class Constants:
    # Dense bf16 GEMMs at LLM sizes reach 60-75% of the tensor-core peak in cuBLAS; attention, norms
    # and elementwise kernels pull a training step lower. Megatron-LM reports 52% of A100 peak
    # end to end *including* its communication (Narayanan et al. 2021, arXiv:2104.04473, table 1);
    # communication is counted separately here, so compute alone gets a little more.
    train_eff: float = 0.55
    # Forward-only passes (log-probs, values, reward scores, prefill): same GEMMs, no backward, larger
    # batches; assumed slightly better than training.
    forward_eff: float = 0.6
    # Decode is memory-bound: each step reads the weights and the KV cache once. An assumption to
    # calibrate: well-tuned decode kernels (vLLM's paged attention, cuBLAS GEMV-like GEMMs) are
    # commonly measured at 60-80% of the HBM datasheet bandwidth; 0.7.
    decode_bw_eff: float = 0.7
    # When a decode batch is large enough to be compute-bound, its small GEMMs run below prefill's.
    decode_flops_eff: float = 0.4
    # Per decode step, CPU-side scheduling/sampling in vLLM not hidden by CUDA graphs: an assumption
    # (about a millisecond per step with recent vLLM), the first constant to calibrate.
    decode_step_overhead_s: float = 1e-3
    # Ring collectives' achieved bus bandwidth over the link's one-way bandwidth (nccl-tests
    # all_reduce busbw on NVLink/InfiniBand is typically 75-90% of the link's rate).
    comm_eff: float = 0.8
    # Small-message collective latency: NCCL's LL protocol / vLLM's custom all-reduce within a node
    # take ~10 us for a decode-sized tensor; across nodes over InfiniBand a few times more.
    latency_intra_s: float = 10e-6
    latency_inter_s: float = 30e-6
    # FSDP prefetches the next layer's all-gather and Megatron overlaps gradient reduce-scatter with
    # backward (overlap_grad_reduce); assume 80% of the data-parallel traffic is hidden under
    # compute at best.
    dp_overlap: float = 0.8
    # Of the device's memory a role may plan for: vLLM's default gpu_memory_utilization is 0.9; in
    # training the CUDA context, NCCL buffers and allocator fragmentation take the same share.
    mem_usable: float = 0.9
    # Adam's update is memory-bound: per parameter it reads the fp32 master, two moments and the
    # gradient and writes the master, the moments and the bf16 copy: ~28 bytes.
    optimizer_bytes_per_param: float = 28.0
    # Logits per token per vocabulary entry: bf16 output + its fp32 upcast for log-softmax.
    logits_bytes: float = 6.0


DEFAULT = Constants()

# Bytes of training state per parameter before sharding (mixed precision, Adam):
# FSDP as this project runs it (workers/engines/fsdp_layout.py; ZeRO-3 accounting, Rajbhandari et
# al. 2020, arXiv:1910.02054 section 3.1): fp32 parameter (the master) 4 + fp32 gradient 4 + two
# fp32 Adam moments 8 = 16, all sharded over fsdp_shard.
FSDP_STATE = {"weights": 4, "grads": 4, "optimizer": 8}
# Megatron with the distributed optimizer (Megatron-LM docs, "Distributed Optimizer": bf16 param +
# fp32 grad = 6 bytes replicated, fp32 master + 2 moments = 12 bytes sharded over dp). The weights
# are stored in the training dtype (``param_bytes``; 2 for bf16).
MEGATRON_STATE = {"weights": 2, "grads": 4, "optimizer": 12}


def role_params(w: Workload, role: str) -> int:
    """Parameters of a role's model; the critic and reward model swap the LM head for a scalar head."""
    shape = w.model_of(role)
    p = shape.params
    if role in ("critic", "reward_model") and not shape.tied:
        p -= shape.vocab * shape.hidden - shape.hidden
    return p


def intra_limit(pool: Pool, cluster: Cluster) -> int:
    """How many of a pool's devices share a node: its per-node share, or a whole node."""
    per_node = pool.per_node or cluster.slots_per_node
    return max(1, min(pool.slots, per_node))


class Coster:
    """The cost model for one workload on one cluster (constants overridable)."""

    def __init__(self, workload: Workload, cluster: Cluster, consts: Constants = DEFAULT):
        dtype = "bf16" if workload.param_bytes == 2 else "fp32"
        m = cluster.device.measured or {}
        if m.get("collective_latency_s") is not None:
            consts = replace(consts, latency_intra_s=m["collective_latency_s"], latency_inter_s=m["collective_latency_s"])
        self.w, self.c, self.k = workload, cluster, consts
        self.peak = cluster.device.flops_for(dtype)
        # A calibrated profile's achieved rates replace peak x efficiency (they already hold attention,
        # norms and the optimizer at the measured sizes, so FLOPs are then counted as 2N / 6N a token).
        self.m_fwd = (m.get("fwd_flops") or {}).get(dtype)
        self.m_train = (m.get("train_flops") or {}).get(dtype)
        self.m = m
        self.m_decode = (m.get("decode_flops") or {}).get(dtype)
        self.m_step = (m.get("decode_step_s_by_dtype") or {}).get(dtype, m.get("decode_step_s"))

    # ---- per-role dtype ----------------------------------------------------------------------------
    def role_bytes(self, role: str) -> int:
        """Bytes per parameter a role computes in: ``workload.extra["role_bytes"]`` (the runtime's
        reward model is fp32 beside a bf16 actor), else ``param_bytes``."""
        return (self.w.extra.get("role_bytes") or {}).get(role, self.w.param_bytes)

    def _rate(self, kind: str, role: str) -> float | None:
        """A measured rate (``fwd_flops``/``train_flops``) in the role's dtype, if calibrated."""
        dtype = "bf16" if self.role_bytes(role) == 2 else "fp32"
        return (self.m.get(kind) or {}).get(dtype)

    def _peak(self, role: str) -> float:
        return self.c.device.flops_for("bf16" if self.role_bytes(role) == 2 else "fp32")

    # ---- communication -------------------------------------------------------------------------
    def link(self, span: int, limit: int, kind: str = "all_reduce") -> tuple[float, float]:
        """(bus bandwidth, latency). Within a node a calibrated profile's measured bandwidth of this
        collective (``measured[kind + "_bw"]``: gloo's all-gather and reduce-scatter run at a third of
        its all-reduce's rate on a CPU host) replaces the link's."""
        if span <= limit:
            measured = self.m.get(f"{kind}_bw")
            bw = measured if measured else self.c.device.intra_node_bw * self.k.comm_eff
            return bw, self.k.latency_intra_s
        return self.c.device.inter_node_bw * self.k.comm_eff, self.k.latency_inter_s

    def all_reduce(self, nbytes: float, group: int, span: int, limit: int) -> float:
        """Ring all-reduce: each member sends and receives 2 (g-1)/g of the tensor."""
        if group <= 1:
            return 0.0
        bw, lat = self.link(span, limit)
        return lat + 2 * (group - 1) / group * nbytes / bw

    def all_gather(self, nbytes: float, group: int, span: int, limit: int, kind: str = "all_gather") -> float:
        """Ring all-gather (or reduce-scatter, ``kind``) of a tensor of ``nbytes`` in all: (g-1)/g of it moves."""
        if group <= 1:
            return 0.0
        bw, lat = self.link(span, limit, kind)
        return lat + (group - 1) / group * nbytes / bw

    # ---- FLOPs -----------------------------------------------------------------------------------
    def fwd_flops_per_token(self, role: str, ctx: float) -> float:
        """2P for the matmuls (Kaplan et al. 2020) + attention's QK^T and AV: 4 L q_dim ctx (q_dim =
        heads x head_dim, h in the textbook), ctx the mean causal context of a token."""
        shape = self.w.model_of(role)
        return 2 * role_params(self.w, role) + 4 * shape.layers * shape.q_dim * ctx

    def _fwd_s_per_token(self, role: str, ctx: float) -> float:
        """Seconds of one device for one token's forward (the measured rate, or peak x efficiency)."""
        rate = self._rate("fwd_flops", role)
        if rate:
            return 2 * role_params(self.w, role) / rate
        return self.fwd_flops_per_token(role, ctx) / (self._peak(role) * self.k.forward_eff)

    def _train_s_per_token(self, role: str, ctx: float) -> float:
        """Forward + backward (+ recompute) of one token: 6P (8P) FLOPs, or the measured step rate."""
        rate = self._rate("train_flops", role)
        if rate:
            return 6 * role_params(self.w, role) / rate
        passes = 4 if self.w.recompute else 3  # forward + backward (2x) [+ recomputed forward]
        return passes * self.fwd_flops_per_token(role, ctx) / (self._peak(role) * self.k.train_eff)

    # ---- memory ----------------------------------------------------------------------------------
    def state_bytes(self, role: str, lay: RoleLayout, trained: bool) -> dict:
        """Weights, gradients and optimizer state per device (which of them stay resident between
        stages: ``resident_bytes``)."""
        p = role_params(self.w, role) / (lay.tp * lay.pp)
        b = self.w.param_bytes
        if not trained:
            b = self.role_bytes(role)
            shard = lay.fsdp_shard if lay.strategy == "fsdp" else 1
            return {"weights": p * b / shard, "grads": 0.0, "optimizer": 0.0}
        if lay.strategy == "megatron":
            st = MEGATRON_STATE
            return {"weights": p * b, "grads": p * st["grads"],
                    "optimizer": p * st["optimizer"] / lay.fsdp_shard}
        st = FSDP_STATE
        return {k: p * v / lay.fsdp_shard for k, v in st.items()}

    def layer_act_bytes(self, role: str, seqs: int, tp: int) -> float:
        """Activations one Llama layer keeps for backward, per device, bf16, flash-attention, with
        sequence parallelism (all split by tp): four s x b x h tensors (each block's norm input and
        output), Q and the attention output (s x b x q_dim, h in the textbook), K and V (s x b x
        kv_dim each), four s x b x ffn tensors (SwiGLU's gate, up, SiLU(gate) and their product),
        2 bytes each. Derived as Korthikanti et
        al. 2022 do for GPT (arXiv:2205.05198, eq. 1: 34 sbh, whose 5as^2/h term flash-attention drops)."""
        shape = self.w.model_of(role)
        s = self.w.seq_len
        return seqs * s * (8 * shape.hidden + 4 * shape.q_dim + 4 * shape.kv_dim + 8 * shape.ffn) / tp

    def activation_bytes(self, role: str, lay: RoleLayout, trained: bool) -> float:
        """Peak per device for one micro-batch. Trained: with full recompute every layer keeps its
        input (2 sbh / tp) and one layer is live; without, all layers' activations; under 1F1B the
        first stage holds pp micro-batches of L/pp layers = L layers' worth (Korthikanti 4.2.3).
        Logits (LM head roles) over a vocabulary split by tp; FSDP's two prefetched gathered layers."""
        shape = self.w.model_of(role)
        mb, s = self.w.micro_batch, self.w.seq_len
        layer = self.layer_act_bytes(role, mb, lay.tp)
        if trained:
            keep = (shape.layers * mb * s * shape.hidden * 2 / lay.tp + layer) if self.w.recompute \
                else shape.layers * layer
        else:
            keep = layer
        logits = mb * s * shape.vocab * self.k.logits_bytes / lay.tp if role in ("actor", "ref") else 0.0
        gathered = 0.0
        if lay.strategy == "fsdp" and lay.fsdp_shard > 1:
            gathered = 2 * shape.layer_params * self.w.param_bytes / lay.tp
        return keep + logits + gathered

    def kv_per_seq(self, tp_g: int) -> float:
        """KV cache of one full-length sequence per device; GQA heads split over tp_g (replicated
        when tp_g exceeds the KV heads, as vLLM does)."""
        shape = self.w.actor
        heads_per = max(1, shape.kv_heads // tp_g) if tp_g <= shape.kv_heads else 1
        per_tok = 2 * shape.layers * heads_per * shape.head_dim * self.w.param_bytes
        return per_tok * self.w.seq_len

    def gen_weight_bytes(self, tp_g: int) -> float:
        return role_params(self.w, "actor") * self.w.param_bytes / tp_g

    # ---- stages ----------------------------------------------------------------------------------
    def _pp_factor(self, micro: int, pp: int) -> float:
        """1F1B pipeline bubble (Narayanan et al. 2021): (m + p - 1) / m of the ideal time."""
        return (micro + pp - 1) / micro if pp > 1 else 1.0

    def forward_s(self, role: str, lay: RoleLayout, pool: Pool) -> float:
        """A forward pass over the whole batch (log-probs, values or scores)."""
        w, shape, lim = self.w, self.w.model_of(role), intra_limit(pool, self.c)
        seqs = math.ceil(w.sequences / lay.dp)
        micro = max(1, math.ceil(seqs / w.micro_batch))
        compute = seqs * w.seq_len * self._fwd_s_per_token(role, w.seq_len / 2) / (lay.tp * lay.pp)
        compute *= self._pp_factor(micro, lay.pp)
        act = w.micro_batch * w.seq_len * shape.hidden * w.param_bytes
        tp_comm = micro * shape.layers / lay.pp * 2 * self.all_reduce(act, lay.tp, lay.tp, lim)
        dp_comm = 0.0
        if lay.strategy == "fsdp" and lay.fsdp_shard > 1:
            full = role_params(w, role) * w.param_bytes / (lay.tp * lay.pp)
            dp_comm = micro * self.all_gather(full, lay.fsdp_shard, lay.fsdp_shard * lay.tp * lay.pp, lim)
        return compute + tp_comm + max(0.0, dp_comm - self.k.dp_overlap * compute)

    def train_s(self, role: str, lay: RoleLayout, pool: Pool) -> float:
        """``ppo_epochs`` x ``mini_batches`` updates: 6P per token (8P with recompute's second
        forward), TP all-reduces per layer, data-parallel traffic, pipeline bubble, Adam's update."""
        w, shape, lim = self.w, self.w.model_of(role), intra_limit(pool, self.c)
        per_mini = math.ceil(w.sequences / w.mini_batches / lay.dp)
        micro = max(1, math.ceil(per_mini / w.micro_batch))
        compute = per_mini * w.seq_len * self._train_s_per_token(role, w.seq_len / 2) / (lay.tp * lay.pp)
        compute *= self._pp_factor(micro, lay.pp)
        act = w.micro_batch * w.seq_len * shape.hidden * w.param_bytes
        # two all-reduces per layer in each forward (the recomputed one too) and two in backward
        comm_passes = 3 if w.recompute else 2
        tp_comm = micro * shape.layers / lay.pp * 2 * comm_passes * self.all_reduce(act, lay.tp, lay.tp, lim)
        p_dev = role_params(w, role) / (lay.tp * lay.pp)
        span = lay.dp * lay.tp * lay.pp
        if lay.strategy == "fsdp":
            shard = lay.fsdp_shard
            # per micro-batch: gather bf16 params for forward and again for backward (FSDP2 reshards
            # after forward), reduce-scatter fp32 grads (reduce_dtype float32, workers/engines/fsdp_layout.py)
            group = (shard, shard * lay.tp * lay.pp, lim)
            dp = micro * (2 * self.all_gather(p_dev * w.param_bytes, *group)
                          + self.all_gather(p_dev * 4, *group, kind="reduce_scatter"))
            if lay.dp > shard:  # hybrid shard: all-reduce the shard's grads across replicas per update
                dp += self.all_reduce(p_dev * 4 / shard, lay.dp // shard, span, lim)
            opt_params = p_dev / shard
        else:
            # distributed optimizer: reduce-scatter grads, all-gather updated params, once per update
            dp = 2 * self.all_gather(p_dev * w.param_bytes, lay.dp, span, lim)
            opt_params = p_dev / lay.fsdp_shard
        # (a measured training rate already holds the optimizer step)
        optimizer = 0.0 if self.m_train else opt_params * self.k.optimizer_bytes_per_param / self.c.device.mem_bw
        one = compute + tp_comm + max(0.0, dp - self.k.dp_overlap * compute) + optimizer
        return w.ppo_epochs * w.mini_batches * one

    def generate_s(self, rollout: RoleLayout, kv_bytes_free: float, pool: Pool) -> tuple[float, int]:
        """Generation on ``rollout.dp`` replicas of ``rollout.tp`` devices: per replica, waves of
        as many sequences as the free KV memory holds; each wave prefills the prompts (FLOP-bound)
        and decodes ``response_len`` steps, each bound by reading weights + KV over memory
        bandwidth or by FLOPs, plus two TP all-reduces per layer and the step's CPU overhead.
        Returns (seconds, the decode batch per replica)."""
        w, k, shape = self.w, self.k, self.w.actor
        tp = rollout.tp
        seqs = math.ceil(w.sequences / rollout.dp)
        batch = max(1, min(seqs, int(kv_bytes_free // self.kv_per_seq(tp))))
        waves = math.ceil(seqs / batch)
        lim = intra_limit(pool, self.c)
        ar = lambda nbytes: self.all_reduce(nbytes, tp, tp, lim)
        prefill = batch * w.prompt_len * self._fwd_s_per_token("actor", w.prompt_len / 2) / tp + \
            shape.layers * 2 * ar(batch * w.prompt_len * shape.hidden * w.param_bytes)
        ctx = w.prompt_len + w.response_len / 2
        comm = shape.layers * 2 * ar(batch * shape.hidden * w.param_bytes)
        if self.m_decode:  # measured: a fixed cost a step + a cost a sequence (calibrate.decode_cost)
            step = (self.m_step or 0.0) + batch * 2 * role_params(w, "actor") / tp / self.m_decode + comm
        else:
            kv_read = batch * self.kv_per_seq(tp) * ctx / w.seq_len
            mem_t = (self.gen_weight_bytes(tp) + kv_read) / (self.c.device.mem_bw * k.decode_bw_eff)
            fl_t = batch * self.fwd_flops_per_token("actor", ctx) / tp / (self.peak * k.decode_flops_eff)
            step = max(mem_t, fl_t) + comm + k.decode_step_overhead_s
        return waves * (prefill + w.response_len * step), batch

    def reshard_s(self, lay: RoleLayout, rollout: RoleLayout, pool: Pool) -> float:
        """Training -> generation layout on the same devices (HybridFlow section 5). Megatron with the
        3D-HybridEngine: each device all-gathers within its micro-DP group the part of its
        generation shard it lacks, P b (1/tp_g - 1/(tp pp)) (the paper's table 2). FSDP (as verl and
        this project do it): the full parameters are gathered over the shard group, P b (s-1)/s,
        and the rollout keeps its own tp_g slice. Generation -> training frees, no traffic."""
        w, lim = self.w, intra_limit(pool, self.c)
        pb = role_params(w, "actor") * w.param_bytes
        if lay.strategy == "megatron":
            mp = lay.tp * lay.pp
            group = max(1, mp // rollout.tp)
            return self.all_gather(pb / rollout.tp, group, mp, lim)
        return self.all_gather(pb, lay.fsdp_shard, lay.fsdp_shard * lay.tp * lay.pp, lim)

    def weight_sync_s(self, rollout: RoleLayout, same_node: bool) -> float:
        """Trainer pool -> separate rollout pool after an update: every rollout device receives its
        tp_g slice (P b / tp_g) at its link's rate (a pipelined broadcast keeps senders off the
        critical path). The runtime today goes through host memory (docs/placement.md), slower."""
        pb = role_params(self.w, "actor") * self.w.param_bytes
        bw = (self.c.device.intra_node_bw if same_node else self.c.device.inter_node_bw) * self.k.comm_eff
        return self.k.latency_inter_s + pb / rollout.tp / bw


def with_overrides(consts: Constants, overrides: dict | None) -> Constants:
    if not overrides:
        return consts
    unknown = set(overrides) - set(Constants.__dataclass_fields__)
    if unknown:
        raise KeyError(f"unknown cost constants {sorted(unknown)}: known {sorted(Constants.__dataclass_fields__)}")
    return replace(consts, **overrides)


TRAINED = ("actor", "critic")


def resident_bytes(mem: dict, lay: RoleLayout | None) -> float:
    """What stays allocated between stages: weights and optimizer state; Megatron's fp32 gradient
    buffer too (allocated once), while FSDP's gradients are freed by zero_grad(set_to_none)."""
    out = mem["weights"] + mem["optimizer"]
    if lay is not None and lay.strategy == "megatron":
        out += mem["grads"]
    return out


def role_memory(coster: Coster, plan, role: str) -> dict:
    """Bytes per device of one role under ``plan``: weights, grads, optimizer, activations, kv_cache.
    ``rollout`` is the actor's generation layout: its weights (tp_g slice) and the KV cache that
    the whole replica batch would need at full length (what vLLM may use is capped by what is free,
    see simulate.py)."""
    if role == "rollout":
        r = plan.rollout
        seqs = math.ceil(coster.w.sequences / r.dp)
        return {"weights": coster.gen_weight_bytes(r.tp), "grads": 0.0, "optimizer": 0.0,
                "activations": 0.0, "kv_cache": seqs * coster.kv_per_seq(r.tp)}
    lay = plan.layouts[role]
    trained = role in TRAINED
    out = dict(coster.state_bytes(role, lay, trained))
    out["activations"] = coster.activation_bytes(role, lay, trained)
    out["kv_cache"] = 0.0
    return out


def memory(workload: Workload, cluster: Cluster, plan, role: str, consts: Constants = DEFAULT) -> dict:
    """Per-device bytes of ``role`` under ``plan`` (see ``role_memory``), with ``total``."""
    out = role_memory(Coster(workload, cluster, consts), plan, role)
    out["total"] = sum(out.values())
    return out
