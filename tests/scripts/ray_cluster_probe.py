"""Stand-in entry for scripts/slurm/ray_on_slurm.sh until a tiny recipe replaces it in the test.

Takes Hydra-style overrides like a recipe (only `trainer.default_local_dir=` is read), joins the
Ray cluster the batch script started, runs remote tasks on it, and logs one step to
<default_local_dir>/metrics.jsonl through the tracker, as a recipe would.
"""
import os
import sys

import ray

from hybridflow.tracking import Tracker


@ray.remote(num_cpus=1)
def square_in_job(x: int) -> tuple[int, str | None]:
    # The worker's environment shows whether the raylet was started by the Slurm step.
    return x * x, os.environ.get("SLURM_JOB_ID")


def main(overrides: list[str]) -> None:
    settings = dict(o.split("=", 1) for o in overrides)
    out_dir = settings["trainer.default_local_dir"]
    ray.init(address="auto", logging_level="ERROR")
    gcs = ray.get_runtime_context().gcs_address
    # Ports, not full addresses: Ray may name the head by another of its IPs.
    if gcs.rsplit(":", 1)[1] != os.environ["RAY_ADDRESS"].rsplit(":", 1)[1]:
        sys.exit(f"probe joined {gcs}, not the Slurm cluster {os.environ['RAY_ADDRESS']}")
    results = ray.get([square_in_job.remote(i) for i in range(8)], timeout=120)
    job_ids = {job for _, job in results}
    if job_ids != {os.environ["SLURM_JOB_ID"]}:
        sys.exit(f"tasks ran outside Slurm job {os.environ['SLURM_JOB_ID']}: {job_ids}")
    nodes = sum(n["Alive"] for n in ray.nodes())
    with Tracker(["jsonl"], "slurm_probe", "probe", out_dir) as tracker:
        tracker.log({"probe/sum_of_squares": sum(v for v, _ in results),
                     "probe/ray_nodes": nodes,
                     "probe/ray_cpus": ray.cluster_resources().get("CPU", 0)}, step=1)
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1:])
