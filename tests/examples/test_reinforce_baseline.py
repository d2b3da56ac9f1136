"""``examples/reinforce_baseline.py`` runs as a user runs it: a new algorithm driving the worker
groups directly (generate, score, advantages, update) for two steps, with a real gradient."""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from tests.recipes.conftest import REPO, recipe_assets  # noqa: F401  (the shared session fixture)


@pytest.mark.slow
def test_example_trains_two_steps_with_a_gradient(recipe_assets, tmp_path):  # noqa: F811
    overrides = [o for o in recipe_assets.overrides(str(tmp_path)) if not o.startswith("trainer.test_freq")]
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    result = subprocess.run([sys.executable, os.path.join(REPO, "examples", "reinforce_baseline.py"), *overrides],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    steps = re.findall(r"^step (\d+): score ([-\d.]+)  pg_loss ([-+\d.e]+)  grad_norm ([-\d.e]+)$",
                       result.stdout, flags=re.M)
    assert [int(s[0]) for s in steps] == [1, 2], result.stdout
    for _, score, pg_loss, grad_norm in steps:
        assert 0.0 <= float(score) <= 1.0 and math.isfinite(float(pg_loss))
        # the graded reward differs within a prompt's samples: the leave-one-out advantage is not 0
        assert float(grad_norm) > 0.0
    assert os.path.isfile(os.path.join(str(tmp_path), "hf", "model.safetensors")), result.stdout
