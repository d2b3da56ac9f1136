"""Weight sync into vLLM: which warnings and log lines a sync keeps, and the live-weights switch."""
import logging
import os

import pytest


@pytest.mark.parametrize("tied", [True, False])
def test_weight_sync_hides_only_the_expected_reload_warnings(tied):
    from workers.rollout.vllm_weight_sync import ExpectedReloadWarnings

    keep = ExpectedReloadWarnings(tied).filter
    warn = lambda layer: logging.LogRecord("vllm", logging.WARNING, "layerwise.py", 266,  # noqa: E731
                                           "%s: Failed to load weights", (layer,), None)
    assert not keep(warn("RotaryEmbedding"))  # has no weights
    assert keep(warn("ParallelLMHead")) is not tied  # tied: shares the embedding, re-tied after
    assert keep(warn("QKVParallelLinear"))  # a weight the sync missed still shows


def test_per_sync_info_lines_are_quieted_at_their_source():
    """The loggers vLLM's reload and prefix-cache reset print through drop INFO, keep WARNING."""
    from vllm.model_executor.model_loader.reload import inplace
    from vllm.v1.core import block_pool

    from workers.rollout.vllm_weight_sync import quiet_per_sync_logs

    quiet_per_sync_logs()
    for logger in (inplace.logger, block_pool.logger):
        assert not logger.isEnabledFor(logging.INFO) and logger.isEnabledFor(logging.WARNING), logger.name


def test_linears_keep_weights_only_while_building():
    """vLLM's CPU linears skip their repack (and keep their weight) inside the context only."""
    from vllm.model_executor.layers.linear import LinearBase

    from workers.rollout.vllm_weight_sync import linears_keep_weights

    assert not getattr(LinearBase, "_cpu_skip_gemm_dispatch", False)
    with linears_keep_weights():
        assert LinearBase._cpu_skip_gemm_dispatch is True
    assert not getattr(LinearBase, "_cpu_skip_gemm_dispatch", False)


class _Worker:
    """What use_live_weights/load_live_weights see of vLLM's worker: model_runner.get_model()."""

    def __init__(self, model):
        import torch

        config = type("ModelConfig", (), {"dtype": torch.float32})()
        self.model_runner = type("Runner", (), {"get_model": lambda _self: model, "model_config": config})()


def _packed_linear(weight):
    import torch
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    layer = torch.nn.Module()
    layer.quant_method = UnquantizedLinearMethod()
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.cpu_linear = lambda x, w, b: torch.zeros(())  # stands for a kernel handle to rebuild
    return layer


def test_live_weights_pack_every_gemm_from_its_weight_and_follow_a_sync():
    import torch

    from workers.rollout.vllm_weight_sync import load_live_weights, use_live_weights

    model = torch.nn.Sequential(_packed_linear(torch.randn(24, 16)), _packed_linear(torch.randn(8, 24)))

    def load_weights(weights):  # what vLLM's per-model loaders do: copy in, report names
        params = dict(model.named_parameters())
        names = set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            names.add(name)
        return names

    model.load_weights = load_weights
    worker = _Worker(model)
    assert use_live_weights(worker) is None
    x = torch.randn(5, 16)

    def forward():
        return model[1].cpu_linear(model[0].cpu_linear(x, model[0].weight, None), model[1].weight, None)

    torch.testing.assert_close(forward(), x @ model[0].weight.T @ model[1].weight.T)
    new = torch.randn(24, 16)
    missing = load_live_weights(worker, iter([("0.weight", new)]))
    assert missing == ["1.weight"]
    torch.testing.assert_close(model[0].weight, new)
    torch.testing.assert_close(forward(), x @ new.T @ model[1].weight.T)  # the kernel follows


def test_live_weights_decline_models_whose_weights_vllm_transforms():
    """A layer vLLM freed the weight of, or a quantized/MoE method: nothing changes, reason given."""
    import torch
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    from workers.rollout.vllm_weight_sync import use_live_weights

    freed = torch.nn.Sequential(_packed_linear(torch.randn(3, 4)), _packed_linear(torch.empty(0)))
    packed = freed[0].cpu_linear
    assert "kept no plain 2-D weight" in use_live_weights(_Worker(freed))
    assert freed[0].cpu_linear is packed

    class Int4Method(QuantizeMethodBase):
        def create_weights(self, *args, **kwargs):
            pass

        def apply(self, layer, *args, **kwargs):
            pass

    quantized = torch.nn.Sequential(_packed_linear(torch.randn(3, 4)), torch.nn.Module())
    quantized[1].quant_method = Int4Method()
    packed = quantized[0].cpu_linear
    assert "Int4Method" in use_live_weights(_Worker(quantized))
    assert quantized[0].cpu_linear is packed


@pytest.mark.slow
def test_a_bf16_engine_synced_with_fp32_weights_equals_one_loaded_from_them(tmp_path):
    """A trainer sends fp32 (master) weights; a bf16 engine that loaded the same weights from a
    checkpoint must give the same log-probs, else a val_only run of the export does not reproduce
    the run's last validation. On AMX CPUs vLLM's small-GEMM kernel keeps biases in fp32, and a
    bias copied in unrounded moved log-probs by up to 0.016."""
    import torch
    from safetensors.torch import load_file, save_file
    from vllm import LLM, SamplingParams

    import hybridflow.device  # noqa: F401  (AMX permission before vLLM's kernels run)
    from hybridflow.tiny import make_tiny_checkpoint
    from workers.rollout.vllm_weight_sync import linears_keep_weights, load_live_weights, use_live_weights

    model = make_tiny_checkpoint(str(tmp_path / "model"), "qwen2", seed=0)
    weights = load_file(os.path.join(model, "model.safetensors"))
    torch.manual_seed(0)  # off bf16's grid, as trained fp32 weights are
    weights = {name: t + 1e-3 * torch.randn_like(t) for name, t in weights.items()}
    fresh, synced = str(tmp_path / "fresh"), str(tmp_path / "synced")
    for folder in (fresh, synced):
        make_tiny_checkpoint(folder, "qwen2", seed=1)
    save_file({n: t.contiguous() for n, t in weights.items()}, os.path.join(fresh, "model.safetensors"))

    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i, 3, 7 + 2 * i]} for i in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=0)

    def logprobs(llm):
        return [[next(iter(step.values())).logprob for step in out.outputs[0].logprobs]
                for out in llm.generate(prompts, params, use_tqdm=False)]

    runs = {}
    for name, folder in (("fresh", fresh), ("synced", synced)):
        with linears_keep_weights():
            llm = LLM(model=folder, dtype="bfloat16", enforce_eager=True, max_model_len=64, seed=0)
        assert llm.collective_rpc(use_live_weights)[0] is None
        if name == "synced":
            llm.collective_rpc(load_live_weights, kwargs={"weights": list(weights.items())})
        runs[name] = logprobs(llm)
        del llm
    assert runs["synced"] == runs["fresh"]
