"""A checkpoint the recipe cannot use is a bad input like any other: one line naming the file and
the way out, exit 2, before Ray starts (it was a traceback and exit 1, or ran the file's code)."""
from __future__ import annotations

import json
import os

import pytest


def _checkpoint(out, cfg, step: int, trainer_state: bytes, manifest_format: int | None = None) -> str:
    from hybridflow.trainer import checkpoint as ckpt
    from hybridflow.trainer.ppo_trainer import worker_layout

    path = ckpt.step_dir(str(out), step)
    os.makedirs(os.path.join(path, "actor"))
    with open(os.path.join(path, ckpt.TRAINER_STATE), "wb") as f:
        f.write(trainer_state)
    ckpt.write_manifest(path, step, worker_layout(cfg))  # regenerated: the hash check alone would catch it
    if manifest_format is not None:
        manifest = json.loads(open(os.path.join(path, ckpt.MANIFEST)).read())
        manifest["format"] = manifest_format
        ckpt.write_atomically(os.path.join(path, ckpt.MANIFEST), json.dumps(manifest))
    ckpt.write_tracker(str(out), step)
    return path


@pytest.mark.parametrize("case", ["garbage", "old_format"])
def test_an_unreadable_trainer_state_exits_2_in_one_line(recipe_assets, tmp_path, capsys, case):
    from recipes.main_ppo import load_and_validate, main

    out = tmp_path / "run"
    argv = ["--config-name", "grpo", *recipe_assets.overrides(str(out)), "trainer.resume_mode=auto"]
    cfg = load_and_validate(argv)
    path = _checkpoint(out, cfg, 2, os.urandom(600), manifest_format=1 if case == "old_format" else None)
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    expected = ("trainer_state.json is not a trainer state" if case == "garbage"
                else f"checkpoint {path} has format 1; this version reads format 2 only")
    # the last line; those before it are the config check's notes (param_dtype=auto, ...)
    assert err.endswith("\n") and err.strip().splitlines()[-1].startswith("checkpoint error: ")
    assert expected in err.strip().splitlines()[-1] and "Traceback" not in err, err
