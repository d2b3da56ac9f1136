"""Benchmark multi-turn rollouts: per-trajectory asynchronous generation vs lockstep batch turns.

64 trajectories of 3 assistant turns; after each turn but the last a tool runs (a BaseTool
subclass that sleeps 50 ms) and its response tokens are appended, as the tool agent loop does.
Turn lengths are long-tailed and seeded: most turns are short (log-normal, median 8 tokens,
clipped to [2, 64]), 5% run long (192 to 256 tokens), as a reasoning model's occasional long turn
does; ``ignore_eos`` makes each turn exactly its drawn length, so both modes generate the same tokens:

- ``per_trajectory``: each trajectory is a coroutine over ROLLOUT's ``EngineTokenServer``
  (workers/rollout/vllm_agent.py): it adds one request per turn to the running engine, and a
  trajectory whose tool is sleeping costs no engine step while the others generate.
- ``lockstep``: the baseline at its best: each turn is one ``llm.generate`` over all 64
  trajectories (vLLM batches them continuously), then all 64 tools run concurrently, then the
  next turn. Each turn waits for its longest generation.

Same tiny model (the demo's size, random weights), greedy; the generated tokens of the two modes
are asserted identical. Runs in one process under a 1-rank gloo world (the rollout's SPMD setting).

    python scripts/bench/agent_loop.py [--trajectories 64 --turns 3 --tool-latency-s 0.05 --repeats 2]

Prints JSON: seconds and generated tokens/s of each mode (best of --repeats), their ratio, and the
lengths' figures. ``ideal_ratio`` (sum over turns of the longest turn / the longest trajectory) is
the speed-up if an engine step cost the same at every batch size and tools took no time; on CPU a
step at 64 sequences costs about twice one at 8 (the tiny model, 2 cores), so the measured ratio
is lower. Plain log-normal lengths (``--long-share 0 --median 16 --max-turn-len 160``) have fewer
long outliers per turn, and the gain shrinks with them.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

MODEL = dict(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, tied=True, seed=0,
             max_positions=1024)  # recipes/demo_tools.py's size, a longer context


def turn_lengths(trajectories: int, turns: int, median: float, sigma: float, lo: int, hi: int, seed: int,
                 long_share: float = 0.0, long_range: tuple[int, int] = (192, 256)):
    """[trajectories][turns] token counts, seeded: log-normal (median, sigma) clipped to [lo, hi];
    with ``long_share`` > 0 that share of turns instead runs long (uniform in ``long_range``), as a
    reasoning model's occasional long turn does."""
    rng = np.random.default_rng(seed)
    draws = np.clip(np.rint(rng.lognormal(np.log(median), sigma, size=(trajectories, turns))), lo, hi)
    long = rng.random((trajectories, turns)) < long_share
    draws = np.where(long, rng.integers(long_range[0], long_range[1] + 1, size=draws.shape), draws)
    return draws.astype(int).tolist()


def ideal_ratio(lengths) -> float:
    """Steps of lockstep turns (each turn as long as its longest) over steps of the longest
    trajectory: the speed-up if an engine step cost the same at every batch size."""
    arr = np.asarray(lengths)
    return float(arr.max(axis=0).sum() / arr.sum(axis=1).max())


def make_sleep_tool(latency_s: float):
    from hybridflow.agent.tools.base import BaseTool, ToolResponse

    class SleepTool(BaseTool):
        """A tool whose work is waiting (an API call, a sandbox): ``latency_s`` of sleep."""

        async def execute(self, instance_id, parameters, **kwargs):
            await asyncio.sleep(latency_s)
            return ToolResponse(text=str(parameters["value"])), None, {}

    schema = {"type": "function", "function": {"name": "wait", "description": "sleeps", "parameters": {
        "type": "object", "properties": {"value": {"type": "string"}}, "required": ["value"]}}}
    return SleepTool({"type": "native", "timeout_s": 5.0}, schema)


def tool_turn_ids(tokenizer, text: str) -> list[int]:
    """The tool turn's tokens after a generated turn (the chat template's, as the loop appends them)."""
    return tokenizer.encode(f"<|im_start|>tool\n<tool_response>{text}</tool_response><|im_end|>"
                            "<|im_start|>assistant\n", add_special_tokens=False)


async def call_tool(tool, tokenizer, traj: int, turn: int, generated: list[int]) -> list[int]:
    instance = await tool.create()
    response, _, _ = await tool.execute(instance, {"value": f"{traj}.{turn}.{generated[-1]}"})
    await tool.release(instance)
    return tool_turn_ids(tokenizer, response.text)


def run_per_trajectory(llm, tool, tokenizer, prompts, lengths, stats: dict | None = None):
    """Each trajectory loops generate -> tool -> generate on its own; returns each one's turns
    (``stats`` gets the engine steps taken)."""
    from workers.rollout.vllm_agent import EngineTokenServer

    context = max(len(p) for p in prompts) + sum(max(t) for t in zip(*lengths)) + 64 * len(lengths[0])
    server = EngineTokenServer(llm, stop_token_ids=[], ignore_eos=True, context_length=context)

    async def trajectory(i: int):
        ids, turns = list(prompts[i]), []
        for t, n in enumerate(lengths[i]):
            out = await server.generate(f"traj-{i}-{t}", ids, dict(temperature=0.0, max_tokens=n))
            turns.append(list(out.token_ids))
            ids += out.token_ids
            if t + 1 < len(lengths[i]):
                ids += await call_tool(tool, tokenizer, i, t, out.token_ids)
        return turns

    async def everything():
        done = asyncio.get_running_loop().create_future()
        driver = asyncio.ensure_future(server.drive(done))
        try:
            return await asyncio.gather(*(trajectory(i) for i in range(len(prompts))))
        finally:
            done.set_result(None)
            await driver

    turns = asyncio.run(everything())
    if stats is not None:
        stats["engine_steps"] = server.steps
    return turns


def run_lockstep(llm, tool, tokenizer, prompts, lengths):
    """All trajectories generate a turn in one ``llm.generate``, then all tools run concurrently."""
    from vllm import SamplingParams

    ids = [list(p) for p in prompts]
    turns = [[] for _ in prompts]
    for t in range(len(lengths[0])):
        # the sampled token's log-prob, as the rollout of an RL step (and the token server) asks for
        params = [SamplingParams(temperature=0.0, max_tokens=lengths[i][t], ignore_eos=True, detokenize=False,
                                 logprobs=0) for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        for i, out in enumerate(outs):
            turns[i].append(list(out.outputs[0].token_ids))
            ids[i] += out.outputs[0].token_ids
        if t + 1 < len(lengths[0]):
            async def tools():
                return await asyncio.gather(*(call_tool(tool, tokenizer, i, t, turns[i][t]) for i in range(len(ids))))
            for i, extra in enumerate(asyncio.run(tools())):
                ids[i] += extra
    return turns


def timed(repeats: int, fn):
    best, result = None, None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
        best = elapsed if best is None else min(best, elapsed)
    return best, result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trajectories", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tool-latency-s", type=float, default=0.05)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--median", type=float, default=8.0, help="median of the short turns' lengths (tokens)")
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the short turns' lengths")
    ap.add_argument("--max-turn-len", type=int, default=64, help="the short turns' cap")
    ap.add_argument("--long-share", type=float, default=0.05, help="share of turns that run long")
    ap.add_argument("--long-min", type=int, default=192)
    ap.add_argument("--long-max", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29613"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from hybridflow.device import init_distributed
    from hybridflow.tiny import load_tokenizer
    from hybridflow.tiny_chat import make_tiny_chat_checkpoint
    from workers.rollout.base import RolloutConfig
    from workers.rollout.vllm_rollout import VLLMRollout

    init_distributed()
    path = make_tiny_chat_checkpoint(tempfile.mkdtemp(prefix="bench_agent_"), "llama", **MODEL)
    tokenizer = load_tokenizer(path)
    lengths = turn_lengths(args.trajectories, args.turns, args.median, args.sigma, 2, args.max_turn_len, args.seed,
                           args.long_share, (args.long_min, args.long_max))
    rng = np.random.default_rng(args.seed + 1)
    chars = [tokenizer.convert_tokens_to_ids(c) for c in "0123456789+*="]
    prompts = [rng.choice(chars, size=args.prompt_len).tolist() for _ in range(args.trajectories)]
    context = args.prompt_len + args.turns * (max(args.max_turn_len, args.long_max) + 48)
    rollout = VLLMRollout(RolloutConfig(prompt_length=args.prompt_len, response_length=context - args.prompt_len,
                                        max_num_seqs=max(256, args.trajectories)), path)
    tool = make_sleep_tool(args.tool_latency_s)

    run_lockstep(rollout.llm, tool, tokenizer, prompts[:4], [x[:2] for x in lengths[:4]])  # warm-up
    modes, stats = {}, {}
    modes["lockstep"] = timed(args.repeats, lambda: run_lockstep(rollout.llm, tool, tokenizer, prompts, lengths))
    modes["per_trajectory"] = timed(args.repeats, lambda: run_per_trajectory(rollout.llm, tool, tokenizer, prompts,
                                                                              lengths, stats))
    generated = sum(map(sum, lengths))
    assert all(len(turn) == n for traj, ls in zip(modes["lockstep"][1], lengths) for turn, n in zip(traj, ls))
    same = modes["lockstep"][1] == modes["per_trajectory"][1]
    differing = sum(a != b for a, b in zip(modes["lockstep"][1], modes["per_trajectory"][1]))
    result = {name: {"seconds": round(s, 3), "tokens_per_s": round(generated / s, 1)} for name, (s, _) in modes.items()}
    result["per_trajectory"]["engine_steps"] = stats["engine_steps"]
    result["speedup"] = round(modes["lockstep"][0] / modes["per_trajectory"][0], 3)
    result["identical_greedy_outputs"] = same
    result["trajectories_differing"] = differing
    arr = np.asarray(lengths)
    result["lengths"] = {"generated_tokens": generated, "median": float(np.median(arr)), "max": int(arr.max()),
                         "longest_turn_per_turn": arr.max(axis=0).tolist(),
                         "longest_trajectory": int(arr.sum(axis=1).max()),
                         "ideal_ratio": round(ideal_ratio(lengths), 3)}
    result["settings"] = vars(args)
    print(json.dumps(result, indent=2))
    assert same, f"{differing} trajectories' greedy tokens differ between the two modes"
    return result


if __name__ == "__main__":
    main()
