"""A resumed run's TensorBoard curves: each step once, with the value of the attempt that counts.

Read back with TensorBoard's plugin_event_accumulator, the reader the TensorBoard server uses (the
older event_accumulator purges on the first restart marker too, so it would pass where the
server shows two curves)."""
import time

from tensorboard.backend.event_processing.plugin_event_accumulator import EventAccumulator
from tensorboard.util import tensor_util

from hybridflow.tracking import Tracker

CONFIG = {"trainer": {"total_epochs": 2}}


def _attempt(out_dir, steps, scale, drop_after=None, config=CONFIG):
    with Tracker(["tensorboard"], "proj", "exp", str(out_dir), config) as tracker:
        if drop_after is not None:
            tracker.drop_after(drop_after)
        for step in steps:
            tracker.log({"critic/score/mean": step * scale}, step=step)


def _read(out_dir):
    events = EventAccumulator(str(out_dir / "tensorboard"))
    events.Reload()
    scores = [(e.step, tensor_util.make_ndarray(e.tensor_proto).item())
              for e in events.Tensors("critic/score/mean")]
    configs = [(e.step, tensor_util.make_ndarray(e.tensor_proto)[0].decode())
               for e in events.Tensors("config/text_summary")]
    return scores, configs


def test_a_resumed_run_hides_the_steps_its_killed_predecessor_logged_past_the_checkpoint(tmp_path):
    _attempt(tmp_path, range(1, 5), 1.0)  # the killed attempt: checkpoint at 2, logged up to 4
    _attempt(tmp_path, (3, 4), 10.0, drop_after=2,
             config={"trainer": {"total_epochs": 3}})  # resumed, with a changed setting
    scores, configs = _read(tmp_path)
    assert scores == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0)]
    # the first attempt's config, and the resumed one's from the step it applies to
    assert [(step, '"total_epochs": 3' in text) for step, text in configs] == [(0, False), (3, True)]

    _attempt(tmp_path, (4, 5), 100.0, drop_after=3)  # resumed again: earlier files hold restart markers
    assert _read(tmp_path)[0] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 400.0), (5, 500.0)]


def test_a_fresh_run_in_a_used_folder_hides_the_earlier_runs(tmp_path):
    _attempt(tmp_path, range(1, 5), 1.0)
    _attempt(tmp_path, (1, 2), -1.0, drop_after=-1)
    scores, configs = _read(tmp_path)
    assert scores == [(1, -1.0), (2, -2.0)]
    assert [step for step, _ in configs] == [0]
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2  # hidden, not deleted


def test_the_new_event_file_sorts_after_one_from_the_same_second(tmp_path):
    """TensorBoard reads a folder's files in name order and a purge hides only what it read
    before: a file named `...<same second>.<host>.<pid>.10` would sort before `....9`."""
    (tmp_path / "tensorboard").mkdir()
    earlier = tmp_path / "tensorboard" / f"events.out.tfevents.{int(time.time()):010d}.~.1.0"
    earlier.write_bytes(b"")
    _attempt(tmp_path, (1,), 1.0, drop_after=-1)
    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir())[0] == earlier.name
