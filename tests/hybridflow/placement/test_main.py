"""``python -m hybridflow.placement`` prints a plan (and JSON) without starting anything."""
import json
import subprocess
import sys

from hybridflow.placement.__main__ import main


def test_cli_prints_the_chosen_plan_alternatives_and_rejections(capsys):
    assert main(["--actor", "13b", "--critic", "13b", "--reward-model", "13b", "--nodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "chosen: " in out and "predicted step" in out and "peak memory per device" in out
    assert "alternatives" in out


def test_cli_json_and_no_fit_exit_code(capsys):
    assert main(["--actor", "70b", "--critic", "70b", "--nodes", "1", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["chosen"] is None and doc["rejected"]
    assert all("GiB usable" in v["example"] for v in doc["rejected"].values())


def test_cli_imports_neither_ray_nor_torch():
    code = ("import sys; from hybridflow.placement.__main__ import main; main(['--actor', '7b']); "
            "assert 'ray' not in sys.modules and 'torch' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_cli_reads_an_hf_config_and_names_unknown_models(tmp_path, capsys):
    cfg = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
           "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "model_type": "qwen2"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["--actor", str(tmp_path), "--nodes", "1", "--gpus-per-node", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["workload"]["actor_params"] == 494_032_768  # Qwen2.5-0.5B's checkpoint, Q/K/V biases included
    assert main(["--actor", "9b"]) == 2
    assert "unknown model '9b'" in capsys.readouterr().err
