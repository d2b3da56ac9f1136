"""Controller overhead: dispatch a 1024 x 1024 int64 DataProto to 2 workers and collect it back,
vs moving the same bytes with plain Ray (two actors, an echo each, ray.get, torch.cat).

Prints JSON. Both paths run interleaved in one process so machine noise hits them alike.
Usage: python scripts/bench/controller.py [--repeats 15]
"""
import argparse
import json
import statistics
import time

import ray
import torch

from hybridflow.controller import Dispatch, RayClassWithInitArgs, RayWorkerGroup, ResourcePool, Worker, register
from hybridflow.protocol import DataProto


class EchoWorker(Worker):
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def echo(self, data: DataProto) -> DataProto:
        return data


@ray.remote(num_cpus=0.5)
class PlainEcho:
    def echo(self, t):
        return t


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    tokens = torch.randint(0, 50_000, (1024, 1024), dtype=torch.int64)
    data = DataProto.from_dict({"input_ids": tokens})
    pool = ResourcePool([2], cpus_per_slot=0.5)
    group = RayWorkerGroup(pool, RayClassWithInitArgs(EchoWorker), name_prefix="bench")
    plain = [PlainEcho.remote() for _ in range(2)]

    def ours():
        out = group.echo(data)
        assert out.batch["input_ids"].shape == tokens.shape

    def baseline():
        # clone: pickling a view would ship its whole parent storage (twice the bytes)
        halves = [h.clone() for h in tokens.chunk(2)]
        out = torch.cat(ray.get([a.echo.remote(ray.put(h)) for a, h in zip(plain, halves)]))
        assert out.shape == tokens.shape

    for fn in (ours, baseline):  # warm-up
        fn()
    times = {"hybridflow": [], "plain_ray": []}
    for _ in range(args.repeats):
        for name, fn in (("hybridflow", ours), ("plain_ray", baseline)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "bench": "controller_dispatch_collect",
        "payload_bytes": tokens.numel() * tokens.element_size(),
        "workers": 2,
        "repeats": args.repeats,
        "median_s": med,
        "overhead_ratio": med["hybridflow"] / med["plain_ray"],
        "goal": "overhead_ratio < 1.20",
    }, indent=2))
    group.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
