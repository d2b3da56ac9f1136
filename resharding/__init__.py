"""3D-HybridEngine: move actor weights from the training layout to the generation layout.

``layout`` (who is who), ``plan`` (what each rank needs and from whom; pure data),
``transfer`` (bucketed execution over torch.distributed), ``fsdp_stream`` (the same for FSDP),
``shared_params`` (parameters in shared memory: CPU ranks of one host read each other's; zero-copy),
``host_exchange`` (bucket-sized shared buffers, its fallback), ``switch`` (the train <-> generate
context), ``staging`` (weights as byte buckets with headers, for a rollout pool of its own).
Imports neither ``workers`` nor the trainer: the Megatron parameter table comes in as data.
"""
from resharding.layout import GenLayout, TrainLayout, check_layouts, micro_dp_groups, pipeline_groups
from resharding.plan import ModelDims, ReshardPlan, TrainParam, build_plan, plan_from_param_specs
from resharding.switch import RNGStreams, generate_mode
from resharding.fsdp_stream import FSDPWeightStream, fsdp_to_hf_stream
from resharding.transfer import DEFAULT_BUCKET_BYTES, Resharder, TransferStats, drain
from resharding.staging import BucketHeader, StagedWeights, TensorEntry, pack_buckets, unpack_bucket

__all__ = ["GenLayout", "TrainLayout", "check_layouts", "micro_dp_groups", "pipeline_groups", "ModelDims",
           "ReshardPlan", "TrainParam", "build_plan", "plan_from_param_specs", "RNGStreams", "generate_mode",
           "DEFAULT_BUCKET_BYTES", "Resharder", "TransferStats", "drain", "FSDPWeightStream",
           "fsdp_to_hf_stream", "BucketHeader", "StagedWeights", "TensorEntry", "pack_buckets", "unpack_bucket"]
