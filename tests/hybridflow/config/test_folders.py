"""hybridflow/host_checks.py (writable_folder_error): the output-folder check run before Ray starts."""
from __future__ import annotations

import os

from hybridflow.host_checks import writable_folder_error


def test_a_folder_under_a_file_is_named_and_a_new_folder_is_made_and_left_empty(tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    assert writable_folder_error(str(blocker / "sub")) == "Not a directory"
    assert writable_folder_error(str(tmp_path / "new" / "folder")) is None
    assert os.listdir(tmp_path / "new" / "folder") == []  # the probe leaves nothing behind


def test_keep_false_removes_the_folders_the_check_created(tmp_path):
    assert writable_folder_error(str(tmp_path / "a" / "b"), keep=False) is None
    assert os.listdir(tmp_path) == []
