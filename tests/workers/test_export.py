"""scripts/export_hf.py (workers/export.py): FSDP and Megatron (tp=2 x pp=2) training checkpoints -> HF checkpoints.

Each engine trains one step on real gloo ranks (so the weights are no longer the initial ones),
saves its sharded checkpoint and, as the reference, its own ``save_hf`` output. The export runs
afterwards in one plain process (no process group) and must load in transformers with exactly
the reference's tensors and logits.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from hybridflow.tiny import make_tiny_checkpoint
from tests.distributed import run_distributed
from tests.workers.engines.fsdp_helpers import make_rl_batch, policy_gradient_loss

pytestmark = pytest.mark.slow
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_and_save(rank, world, model_path, workdir, strategy, tp, pp):
    from workers import checkpoint as ckpt
    from workers.engines.config import EngineConfig

    config = EngineConfig(strategy=strategy, tp=tp, pp=pp, lr=1e-2, lr_schedule="constant",
                          micro_batch_size_per_gpu=2, seed=0)
    if strategy == "megatron":
        from workers.engines.megatron import MegatronEngine as Engine
    else:
        from workers.engines.fsdp import FSDPEngine as Engine
    engine = Engine(config, model_path, "actor")
    data = make_rl_batch(8, 8, 8, 128, seed=1)
    data.meta_info["temperature"] = 1.0
    n = len(data) // engine.dp_size
    engine.train_batch(data[engine.dp_rank * n:(engine.dp_rank + 1) * n], policy_gradient_loss)
    role_dir = os.path.join(workdir, "global_step_1", "actor")
    engine.save_checkpoint(role_dir)
    if rank == 0:
        ckpt.save_engine_meta(engine, role_dir, world)
    engine.save_hf(os.path.join(workdir, "save_hf"))
    return True


def _load(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _assert_same_model(exported_dir, reference_dir, initial_dir):
    exported, reference, initial = _load(exported_dir), _load(reference_dir), _load(initial_dir)
    ref_state = reference.state_dict()
    assert exported.state_dict().keys() == ref_state.keys()
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, ref_state[name]), name
    ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = exported(input_ids=ids).logits
        assert torch.equal(logits, reference(input_ids=ids).logits)
        # training moved the weights: an export of the untrained model would fail the checks above
        assert not torch.allclose(logits, initial(input_ids=ids).logits, atol=1e-4)


@pytest.fixture(scope="module")
def fsdp_export(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    model = make_tiny_checkpoint(str(root / "model"), arch="llama", tied=False)
    work = root / "run"
    run_distributed(_train_and_save, 2, model, str(work), "fsdp", 1, 1, timeout_s=300)
    out = root / "exported"
    proc = subprocess.run([sys.executable, "scripts/export_hf.py", str(work / "global_step_1"), str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"model": model, "work": work, "out": out}


def test_fsdp_checkpoint_exports_via_cli_with_identical_logits(fsdp_export):
    out, work = fsdp_export["out"], fsdp_export["work"]
    assert sorted(os.listdir(out)) == sorted(os.listdir(work / "save_hf"))
    _assert_same_model(out, work / "save_hf", fsdp_export["model"])


VLLM_GREEDY = """
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=64,
          seed=0)
params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, detokenize=False)
outs = llm.generate([{"prompt_token_ids": ids} for ids in json.loads(sys.argv[2])], params, use_tqdm=False)
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def test_fsdp_export_loads_in_vllm_with_transformers_greedy_tokens(fsdp_export):
    import json

    prompts = [[5, 17, 42, 9], [33, 8, 100, 64, 21]]
    model = _load(fsdp_export["out"])
    with torch.no_grad():
        expected = [model.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(p):]
                    .tolist() for p in prompts]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run([sys.executable, "-c", VLLM_GREEDY, str(fsdp_export["out"]), json.dumps(prompts)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("TOKENS "))
    assert json.loads(line.removeprefix("TOKENS ")) == expected


def test_megatron_tp2_pp2_checkpoint_exports_with_identical_logits(tmp_path):
    from workers.export import export
    from hybridflow.tiny import load_tokenizer

    model = make_tiny_checkpoint(str(tmp_path / "model"), arch="qwen2", tied=True)
    work = tmp_path / "run"
    run_distributed(_train_and_save, 4, model, str(work), "megatron", 2, 2, timeout_s=400)
    out = export(str(work / "global_step_1" / "actor"), str(tmp_path / "exported"))
    _assert_same_model(out, work / "save_hf", model)
    tok = load_tokenizer(out)
    assert tok.decode(tok("12 + 3 =")["input_ids"], skip_special_tokens=True) == "12 + 3 ="


def test_export_of_a_folder_without_checkpoint_is_a_clear_error(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/export_hf.py", str(tmp_path), str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "is not a checkpoint" in proc.stderr and "global_step_N" in proc.stderr


def test_export_of_a_role_the_run_did_not_train_names_the_roles_saved(fsdp_export, tmp_path):
    from workers.export import ExportError, export

    step = fsdp_export["work"] / "global_step_1"
    with pytest.raises(ExportError, match=r"holds no critic checkpoint \(saved roles: actor\).*--role actor"):
        export(str(step), str(tmp_path / "out"), role="critic")
    with pytest.raises(ExportError, match=r"is the actor's checkpoint, not the critic's"):
        export(str(step / "actor"), str(tmp_path / "out"), role="critic")
    assert not (tmp_path / "out").exists()


def test_export_names_an_external_lib_it_cannot_import(tmp_path, capsys):
    from workers.export import main

    assert main([str(tmp_path), str(tmp_path / "out"), "--external-lib", "no_such_module_xyz"]) == 2
    assert capsys.readouterr().err.startswith("export error: --external-lib='no_such_module_xyz' cannot be imported")
