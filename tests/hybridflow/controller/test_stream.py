"""GenerationStream (hybridflow/controller/stream.py), the streaming primitive as a user's own
dataflow drives it: a real Ray group of two vLLM rollout workers, greedy. Chunks come back while
others generate; after the first chunk the unfinished samples move onto one rank; every row comes
back once, and the batch equals the group's generate_sequences, row for row."""
from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.slow

TEXTS = ["12+3=", "hello world", "a", "What is 7*8?", "xyz", "9-4=", "hi", "the cat sat", "b", "1+1="]


def test_a_stream_is_the_generation_chunk_by_chunk_with_a_moved_tail(ray_cluster, tmp_path):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("needs vLLM")
    from hybridflow.controller import RayClassWithInitArgs, RayWorkerGroup, ResourcePool, create_colocated_worker_cls
    from hybridflow.controller.stream import ROW_INDEX, GenerationStream
    from hybridflow.tiny import make_tiny_checkpoint
    from tests.workers.rollout.common import PROMPT_LEN, RESPONSE_LEN, make_prompts
    from workers.rollout.base import RolloutConfig
    from workers.rollout_worker import RolloutWorker, RolloutWorkerSettings

    ckpt = make_tiny_checkpoint(str(tmp_path / "model"), seed=0)
    settings = RolloutWorkerSettings(model_path=ckpt, rollout=RolloutConfig(
        prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, kv_cache_gib=0.125, seed=0, dtype="float32"))
    pool = ResourcePool([2], cpus_per_slot=1, name_prefix="stream", ready_timeout_s=60)
    group = RayWorkerGroup(pool, create_colocated_worker_cls({"rollout": RayClassWithInitArgs(RolloutWorker, settings)}),
                           name_prefix="stream", timeout_s=240).spawn(["rollout"])["rollout"]
    try:
        group.init_model()
        prompts = make_prompts(ckpt, texts=TEXTS, meta=dict(do_sample=False, n=1, stop_token_ids=list(range(3, 23))))
        want = group.generate_sequences(prompts)

        stream = GenerationStream(group, prompts, slice_s=1e-4)  # n from meta_info; one-step slices
        chunks, moved = [], 0
        for chunk in stream:
            chunks.append(chunk)
            if not moved:
                stream.migrate(keep=1)
                moved = stream.moved
        got = stream.batch()
        assert moved > 0 and len(chunks) > 1 and stream.free_ranks()
        rows = torch.cat([c.batch[ROW_INDEX] for c in chunks])
        assert sorted(rows.tolist()) == list(range(len(TEXTS)))  # each row once
        for key in ("responses", "response_mask", "input_ids", "attention_mask", "position_ids"):
            torch.testing.assert_close(got.batch[key], want.batch[key], msg=key)
        torch.testing.assert_close(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"], atol=1e-5, rtol=0)
        assert stream.metrics()["fusion/migrated_samples"] == moved
        with pytest.raises(ValueError, match="samples per prompt"):
            GenerationStream(group, prompts.select(meta_info_keys=[]))
    finally:
        group.shutdown()
        pool.release()
