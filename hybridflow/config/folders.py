"""Is an output folder usable? Checked while the config is validated, before Ray starts, so a bad
``trainer.default_local_dir`` (or ``rollout_data_dir``, ``validation_data_dir``) fails in a
second, not after the first step's work."""
from __future__ import annotations

import os
import tempfile


def writable_folder_error(folder: str, keep: bool = True) -> str | None:
    """None when ``folder`` exists (it is created) and takes new files, else why not. Run before
    Ray starts, so a bad folder fails in a second, not after the first step's work. ``keep=False``
    removes again the folders the check created."""
    created, parent = [], os.path.abspath(folder)
    while not os.path.exists(parent) and os.path.dirname(parent) != parent:
        created.append(parent)
        parent = os.path.dirname(parent)
    try:
        os.makedirs(folder, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()  # a nameless file: nothing is left behind
    except OSError as err:
        return err.strerror or str(err)
    finally:
        for path in created if not keep else ():  # deepest first; only the empty folders made here
            try:
                os.rmdir(path)
            except OSError:
                break
    return None
