import os

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run (a CI gate must not flake on a new draw);
# HYPOTHESIS_PROFILE=explore searches fresh examples each run when hunting for bugs.
settings.register_profile("repeatable", derandomize=True, deadline=None)
settings.register_profile("explore", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# param_dtype=auto picks bf16 on machines whose bf16 matmuls are fast and fp32 elsewhere; the suite
# pins fp32 so its tolerances (vLLM vs trainer log-probs to 1e-3, resumed == uninterrupted) mean
# the same on every machine kind. Tests that want bf16 ask for it.
os.environ.setdefault("HYBRIDFLOW_AUTO_DTYPE", "fp32")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance shared by the tests that ask for it (4 logical CPUs on a 2-core box)."""
    import ray

    from recipes.ray_start import NO_PRESTART

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
                 object_store_memory=512 * 1024**2, _system_config=NO_PRESTART,
                 runtime_env={"env_vars": {"PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


def pytest_collection_modifyitems(config, items):
    """The files with the most slow tests (recipe runs, Ray groups) run first, the quick unit
    files last. `make test` runs two files at a time (pytest-xdist, ``--dist loadfile
    --no-loadscope-reorder``, which hands out whole files in this order): a recipe file started
    late would leave one worker running it alone at the end. The order within a file is kept."""
    paths = {id(item): item.nodeid.split("::")[0] for item in items}
    slow, first_seen = {}, {}
    for i, item in enumerate(items):
        path = paths[id(item)]
        first_seen.setdefault(path, i)
        slow[path] = slow.get(path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (-slow[paths[id(item)]], first_seen[paths[id(item)]]))
