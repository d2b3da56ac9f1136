"""Loading a user reward function from a Python file (`custom_reward_function.path` / `.name`).

The module is executed from its file without being registered in `sys.modules`, so a function
defined there is pickled by value (cloudpickle) and can be shipped to Ray workers that do not
have the file on their import path.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from typing import Any

from hybridflow.rewards.registry import ComputeScoreFn


class RewardFunctionError(ValueError):
    """``custom_reward_function.path`` / ``.name`` do not give a callable; the message says which."""


def load_reward_function(path: str, name: str = "compute_score",
                         reward_kwargs: dict[str, Any] | None = None) -> ComputeScoreFn:
    """Import `path` and return its callable `name`, with `reward_kwargs` bound as keywords.

    Errors name the setting to fix: a missing file (`custom_reward_function.path`), a file that
    fails to import (the original exception is chained; sys.exit() at import included, which
    would otherwise end the run with the file's exit code and nothing said), a missing or non-callable attribute
    (`custom_reward_function.name`, listing the functions the file does define).
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise RewardFunctionError(f"custom_reward_function.path: no such file {path!r}")
    module_name = f"hybridflow_user_reward_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise RewardFunctionError(f"custom_reward_function.path: cannot import {path!r} (is it a .py file?)")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SystemExit as exc:  # sys.exit() at import: not a stop of the run, a file that cannot be used
        raise RewardFunctionError(
            f"custom_reward_function.path: importing {path!r} called sys.exit({exc.code!r}); the file must only "
            "define functions when imported (put script code under `if __name__ == \"__main__\":`)"
        ) from None
    except Exception as exc:
        raise RewardFunctionError(
            f"custom_reward_function.path: importing {path!r} raised {type(exc).__name__}: {exc}"
        ) from exc
    fn = getattr(module, name, None)
    if fn is None or not callable(fn):
        defined = sorted(n for n, v in vars(module).items()
                         if inspect.isfunction(v) and v.__module__ == module_name)
        what = "is not callable" if fn is not None else "is not defined"
        raise RewardFunctionError(
            f"custom_reward_function.name: {name!r} {what} in {path!r}; functions there: {defined}"
        )
    return functools.partial(fn, **reward_kwargs) if reward_kwargs else fn
