"""Curves PNG from metrics.jsonl, via the library call and the command-line script."""
import json
import subprocess
import sys

import matplotlib.image
import pytest

from hybridflow.tracking.plot import plot_metrics


def _write_metrics(path, steps=8, test_freq=4):
    with open(path, "w") as f:
        for step in range(1, steps + 1):
            record = {"step": step, "critic/score/mean": step / steps,
                      "response_length/mean": 40.0 - step}
            if step % test_freq == 0:
                record["val/score/mean"] = step / steps - 0.1
            f.write(json.dumps(record) + "\n")


def test_plot_writes_png_with_both_panels(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl")
    out = plot_metrics(str(tmp_path / "metrics.jsonl"))
    assert out == str(tmp_path / "metrics.png")
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (400, 1100)  # figsize (11, 4) at 100 dpi
    assert image.std() > 0.05  # curves and axes drawn, not a blank canvas


def test_plot_script_writes_given_path(tmp_path):
    _write_metrics(tmp_path / "metrics.jsonl")
    out = tmp_path / "plots" / "curves.png"
    result = subprocess.run([sys.executable, "scripts/plot_metrics.py",
                             str(tmp_path / "metrics.jsonl"), str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_rejects_file_without_the_curves(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "actor/lr": 1e-6}\n')
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_metrics(str(tmp_path / "metrics.jsonl"))
    (tmp_path / "metrics.jsonl").write_text('{"critic/score/mean": 1}\n')
    with pytest.raises(ValueError, match=":1 has no 'step' key"):
        plot_metrics(str(tmp_path / "metrics.jsonl"))
