"""LoRA adapters (workers/engines/lora.py): a fresh adapter changes nothing, merged weights give
the adapted model's logits, and the FSDP engine's LoRA step on 2 ranks (sharded and replicated)
equals a single-process step of the same adapted model; a LoRA critic trains its adapters and its
value head."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.fsdp_helpers import hf_response_log_probs, make_rl_batch, policy_gradient_loss, value_loss

WORLD, ROWS, P, R, VOCAB = 2, 8, 8, 8, 128
TEMP, LR, CLIP, ADAM_EPS, RANK, ALPHA = 0.7, 1e-2, 1.0, 1e-5, 4, 8.0
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("lora") / "model"), "qwen2", layers=2, seed=0)


def _adapted(path, **kwargs):
    from workers.engines.hf_model import load_hf_model
    from workers.engines.lora import add_lora

    torch.manual_seed(0)  # the engine's seed before it loads the model and draws A
    model = load_hf_model(path, "actor")
    names = add_lora(model, RANK, ALPHA, **kwargs)
    return model, names


def _logits(model, batch):
    b = batch.batch
    with torch.no_grad():
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                     position_ids=b["position_ids"]).logits


def test_fresh_adapters_change_nothing_and_merged_weights_give_the_adapted_logits(ckpt):
    from transformers import AutoModelForCausalLM

    from workers.engines.lora import adapters_disabled, lora_scalings, merge_lora

    base = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    model, names = _adapted(ckpt)
    batch = make_rl_batch(4, P, R, VOCAB, seed=1)
    assert len(names) == 2 * LINEARS_PER_LAYER and not any("lm_head" in n for n in names)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(trainable) == sorted(f"{n}.{leaf}" for n in names for leaf in ("lora_A", "lora_B"))
    torch.testing.assert_close(_logits(model.eval(), batch), _logits(base, batch), rtol=0, atol=0)

    for name, p in model.named_parameters():  # a trained adapter: B != 0
        if name.endswith("lora_B"):
            p.data.normal_(0, 0.05)
    merged = dict(merge_lora(model.state_dict().items(), lora_scalings(model)))
    assert not any("lora_" in n for n in merged) and merged.keys() == base.state_dict().keys()
    base.load_state_dict(merged)
    adapted = _logits(model, batch)
    with adapters_disabled(model):  # the reference policy of a LoRA run: the frozen base
        torch.testing.assert_close(_logits(model, batch), _logits(AutoModelForCausalLM.from_pretrained(ckpt).eval(),
                                                                  batch), rtol=0, atol=0)
    assert not torch.allclose(adapted, _logits(AutoModelForCausalLM.from_pretrained(ckpt).eval(), batch), atol=1e-3)
    torch.testing.assert_close(_logits(base, batch), adapted, rtol=0, atol=1e-5)


def test_target_and_exclude_modules(ckpt):
    _, names = _adapted(ckpt, target_modules=["q_proj", "mlp.down_proj"], exclude_modules=["layers.1.self_attn.q_proj"])
    assert sorted(names) == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj",
                             "model.layers.1.mlp.down_proj"]
    with pytest.raises(ValueError, match=r"target_modules \['qproj'\] match no linear layer .*'q_proj'"):
        _adapted(ckpt, target_modules=["qproj"])
    # the LM head (tied here to the embedding) is never adapted, and never offered as a choice
    with pytest.raises(ValueError, match=r"\['lm_head'\] match no linear layer in the decoder layers") as err:
        _adapted(ckpt, target_modules=["lm_head"])
    assert "'lm_head'" not in str(err.value).split("some of")[1]


def _local(p):
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _engine_scenario(rank, world, ckpt, workdir):
    from workers.engines.config import EngineConfig
    from workers.engines.fsdp import FSDPEngine

    batch = make_rl_batch(ROWS, P, R, VOCAB, seed=1)
    n = ROWS // world
    mine = batch[rank * n:(rank + 1) * n]
    mine.meta_info["temperature"] = TEMP
    out = {}
    for fsdp_size in (-1, 1):
        config = EngineConfig(lr=LR, adam_eps=ADAM_EPS, grad_clip=CLIP, weight_decay=0.0, micro_batch_size_per_gpu=2,
                              fsdp_size=fsdp_size, lora_rank=RANK, lora_alpha=ALPHA, seed=0)
        engine = FSDPEngine(config, ckpt, "actor")
        metrics = engine.train_batch(mine, policy_gradient_loss)
        weights = {name: t.clone() for name, t in engine.export_hf_weights()}
        out[fsdp_size] = {"metrics": metrics, "weights": weights if rank == 0 else None,
                          "optimized": sum(_local(p).numel() for g in engine.optimizer.param_groups for p in g["params"]),
                          "log_probs": engine.compute_log_prob(mine, TEMP)[0]}
        # resume: adapters and their optimizer state come back, the next step is the same
        path = os.path.join(workdir, f"ckpt_{fsdp_size}")
        engine.save_checkpoint(path)
        if rank == 0:  # what the HF export reads besides the shards
            from workers.checkpoint import save_engine_meta

            save_engine_meta(engine, path, world)
        second = engine.train_batch(mine, policy_gradient_loss)
        resumed = FSDPEngine(config, ckpt, "actor")
        resumed.load_checkpoint(path)
        out[fsdp_size]["resumed"] = (second["pg_loss"], resumed.train_batch(mine, policy_gradient_loss)["pg_loss"],
                                     _equal_exports(engine, resumed))
        del engine, resumed
    out["critic"] = _critic_lora(mine, ckpt)
    return out


def _critic_lora(mine, ckpt):
    """A LoRA critic: fresh adapters give the plain critic's values; the adapters and the new
    value head (in full) are what trains; the export is a plain token-classification model."""
    from workers.engines.config import EngineConfig
    from workers.engines.fsdp import FSDPEngine

    config = EngineConfig(lr=LR, adam_eps=ADAM_EPS, grad_clip=CLIP, weight_decay=0.0, micro_batch_size_per_gpu=2,
                          lora_rank=RANK, lora_alpha=ALPHA, seed=0)
    plain = FSDPEngine(dataclasses.replace(config, lora_rank=0), ckpt, "critic").compute_values(mine)
    engine = FSDPEngine(config, ckpt, "critic")
    before = {name: t.clone() for name, t in engine.export_hf_weights()}
    out = {"plain": plain, "fresh": engine.compute_values(mine),
           "trained": sorted(n for n, p in engine.model.named_parameters() if p.requires_grad),
           "losses": [engine.train_batch(mine, value_loss)["vf_loss"] for _ in range(3)]}
    after = dict(engine.export_hf_weights())
    out["exported"] = sorted(after)
    out["moved"] = sorted(n for n in after if not torch.equal(after[n], before[n]))
    return out


def _equal_exports(a, b) -> bool:
    return all(torch.equal(x, y) for (_, x), (_, y) in zip(a.export_hf_weights(), b.export_hf_weights()))


@pytest.mark.slow
def test_engine_lora_step_matches_a_single_process_step(ckpt, tmp_path):
    results = run_distributed(_engine_scenario, WORLD, ckpt, str(tmp_path), timeout_s=400)
    model, names = _adapted(ckpt)
    batch = make_rl_batch(ROWS, P, R, VOCAB, seed=1)
    log_probs, mask = hf_response_log_probs(model, batch, TEMP)
    loss = -(batch.batch["advantages"] * log_probs * mask).sum() / mask.sum()
    loss.backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    norm = float(torch.nn.utils.clip_grad_norm_(trainable, CLIP))
    torch.optim.AdamW(trainable, lr=LR, weight_decay=0.0, eps=ADAM_EPS).step()
    from workers.engines.fsdp import _aliased_parameter_names
    from workers.engines.lora import lora_scalings, merge_lora

    aliases = _aliased_parameter_names(model)  # a tied lm_head is exported once, as in an HF checkpoint
    expected = dict(merge_lora(((n, t.detach()) for n, t in model.state_dict().items() if n not in aliases),
                               lora_scalings(model)))
    with torch.no_grad():
        after, _ = hf_response_log_probs(model, batch, TEMP)
    adapter_numel = sum(p.numel() for p in trainable)
    for fsdp_size in (-1, 1):
        per_rank = [r[fsdp_size] for r in results]
        for r in per_rank:
            assert r["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
            assert r["metrics"]["pg_loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-6)
        # the optimizer holds the adapters only (sharded: this rank's half of each)
        optimized = sum(r["optimized"] for r in per_rank)
        assert optimized == (adapter_numel if fsdp_size == -1 else WORLD * adapter_numel)
        got = per_rank[0]["weights"]
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            torch.testing.assert_close(got[name], tensor, rtol=0, atol=2e-6, msg=name)
        # the offline export of the saved step (adapters merged) is the engine's own export
        from workers.export import export
        from safetensors.torch import load_file

        exported = load_file(os.path.join(export(str(tmp_path / f"ckpt_{fsdp_size}"), str(tmp_path / f"hf_{fsdp_size}")),
                                          "model.safetensors"))
        assert exported.keys() == got.keys()
        for name, tensor in got.items():
            torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)
        for r in per_rank:
            reference_loss, resumed_loss, same_weights = r["resumed"]
            assert resumed_loss == reference_loss and same_weights
        new_log_probs = torch.cat([r["log_probs"] for r in per_rank])
        torch.testing.assert_close(new_log_probs[mask], after[mask], rtol=0, atol=2e-5)
    for r in results:
        critic = r["critic"]
        torch.testing.assert_close(critic["fresh"], critic["plain"], rtol=0, atol=0)
        assert critic["trained"] == sorted(["score.weight", "score.bias"]
                                           + [f"{n}.{leaf}" for n in names for leaf in ("lora_A", "lora_B")])
        assert critic["losses"][0] > critic["losses"][1] > critic["losses"][2]
        assert not any("lora_" in n for n in critic["exported"]) and "score.weight" in critic["exported"]
        assert critic["moved"] == sorted(["score.weight", "score.bias"] + [f"{n}.weight" for n in names])
    changed = [n for n in names if not torch.equal(expected[f"{n}.weight"],
                                                   dict(_adapted(ckpt)[0].named_parameters())[f"{n}.weight"])]
    assert changed == names  # every adapted weight moved through its adapter
