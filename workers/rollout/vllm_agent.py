"""Multi-turn, tool-using rollouts on the rollout's in-process vLLM engine (issue 37).

Every row of the batch (times ``n``) is one trajectory run by an agent loop (hybridflow/agent/):
generate, parse tool calls, run the tools, append their responses, generate again. All
trajectories of this rank run concurrently as coroutines on one asyncio event loop, over
:class:`EngineTokenServer`: each ``generate`` adds one request (n=1, the trajectory's token ids so
far) to the engine, and one driver coroutine steps the engine whenever a request is pending,
resolving each request's future in the step that finishes it, and yields to the event loop
between steps. So a trajectory that waits on a tool (its sleep, its I/O) costs no engine step:
the others generate meanwhile, and it re-enters the running batch when its tool returns. There
are no lockstep turns across the batch.

Why the step loop and not vLLM's ``AsyncLLM``: ``AsyncLLM`` runs the engine core in a process of
its own, and the hybrid engine syncs the actor's weights into this process's engine in place
(workers/rollout/vllm_weight_sync.py; ``external_launcher`` keeps the model here). Stepping
``LLM.llm_engine`` by hand gives the same continuous batching without a second process, and the
same requests as ``LLM.generate`` (``LLM.enqueue``), so sampling (temperature, top-k/top-p, the
processed log-probs of the sampled token) is the single-turn path's.

The batch (the rollout contract, workers/rollout/base.py) is built from the loops' outputs: the
loop's prompt ids (the chat template with the tool schemas, not the data set's ``input_ids``)
left-padded to ``prompt_length``, the response (generated ids and tool ids in order)
right-padded to ``response_length``, ``response_mask`` from the loop (0 on tool tokens),
``attention_mask`` 1 on every real token, ``rollout_log_probs`` 0 on tool tokens, plus per-row
agent counts (``agent_*`` columns, hybridflow/trajectory.py) and the tool texts (``tool_outputs``).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import time

import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.trajectory import AGENT_COLUMNS, TOOL_OUTPUTS
from workers.rollout.base import rl_batch_tensors


class EngineTokenServer:
    """The agent loops' TokenServer (hybridflow/agent/loop.py) over an in-process ``vllm.LLM``.

    ``stop_token_ids`` and ``ignore_eos``: the call's (SamplingSettings); each request gets a
    ``SamplingParams`` of its own temperature, top-p, top-k and ``max_tokens`` with those,
    ``logprobs=0`` (the sampled token's) and no detokenization. ``context_length``: the engine's
    max_model_len, checked per call so that an overlong trajectory fails in one line naming the
    settings, not inside vLLM.
    """

    def __init__(self, llm, stop_token_ids, ignore_eos: bool, context_length: int):
        self.llm = llm
        self.engine = llm.llm_engine
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self.ignore_eos = bool(ignore_eos)
        self.context_length = context_length
        # by the id the engine's outputs carry (vLLM's external id); the internal id, for aborts
        self._futures: dict[str, asyncio.Future] = {}
        self._internal: dict[str, str] = {}
        self._wake: asyncio.Event | None = None
        self.steps = 0
        self.requests = 0

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict):
        from hybridflow.agent.loop import TokenOutput

        max_tokens = int(sampling_params["max_tokens"])
        if max_tokens < 1:
            raise ValueError(f"trajectory {request_id}: max_tokens={max_tokens} must be >= 1")
        if len(prompt_ids) + max_tokens > self.context_length:
            raise ValueError(f"rollout.multi_turn: trajectory {request_id}: {len(prompt_ids)} context tokens + "
                             f"max_tokens={max_tokens} exceed the engine's context {self.context_length} = "
                             "data.max_prompt_length + data.max_response_length: its templated prompt (tool schemas "
                             "included) is longer than data.max_prompt_length; raise data.max_prompt_length")
        from vllm import SamplingParams

        params = SamplingParams(n=1, temperature=float(sampling_params.get("temperature", 1.0)),
                                top_p=float(sampling_params.get("top_p", 1.0)), top_k=int(sampling_params.get("top_k", -1)),
                                max_tokens=max_tokens, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                                logprobs=0, detokenize=False)
        [engine_id] = self.llm.enqueue([{"prompt_token_ids": list(prompt_ids)}], params, use_tqdm=False)
        # enqueue returns vLLM's internal id ("<external>-<random>"); outputs carry the external one
        state = getattr(self.engine.output_processor, "request_states", {}).get(engine_id)
        external = getattr(state, "external_req_id", None) or engine_id
        future = asyncio.get_running_loop().create_future()
        self._futures[external] = future
        self._internal[external] = engine_id
        self.requests += 1
        self._wake.set()
        out = await future
        comp = out.outputs[0]
        tokens = list(comp.token_ids)
        log_probs = [step[tok].logprob for tok, step in zip(tokens, comp.logprobs)]
        # cut at the first stop id, as the single-turn path does (base.truncate_at_stop)
        stops = set(self.stop_token_ids)
        for i, tok in enumerate(tokens):
            if tok in stops:
                tokens, log_probs = tokens[: i + 1], log_probs[: i + 1]
                break
        return TokenOutput(tokens[:max_tokens], log_probs[:max_tokens])

    async def drive(self, done: asyncio.Future) -> None:
        """Step the engine while requests are pending, until ``done`` resolves. An engine error
        fails every pending request (their trajectories then fail the call)."""
        self._wake = asyncio.Event()
        while not done.done():
            if not self._futures:
                self._wake.clear()
                waiter = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait([waiter, done], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                continue
            try:
                outputs = self.engine.step()
            except BaseException as err:
                for future in self._futures.values():
                    if not future.done():
                        future.set_exception(err)
                self._futures.clear()
                raise
            self.steps += 1
            for out in outputs:
                if out.finished:
                    future = self._futures.pop(out.request_id, None)
                    self._internal.pop(out.request_id, None)
                    if future is not None and not future.done():
                        future.set_result(out)
            if self._futures and not self.engine.has_unfinished_requests():
                # else this loop would step an empty engine for ever
                raise RuntimeError(f"vLLM finished every request but {len(self._futures)} never came back under "
                                   "the ids enqueue() gave: this vLLM version names requests differently "
                                   "(workers/rollout/vllm_agent.py)")
            await asyncio.sleep(0)  # the loops whose request finished, and the tools' timers, run here

    def abort_pending(self) -> None:
        """Drop requests whose trajectory failed (the engine must be empty for the next call)."""
        if self._futures:
            self.engine.abort_request([self._internal[k] for k in self._futures], internal=True)
            for future in self._futures.values():
                future.cancel()
            self._futures.clear()
            self._internal.clear()


@dataclasses.dataclass
class AgentRunner:
    """What a rank's agent loops share across calls: the tokenizer, the tools and the settings."""

    tokenizer: object
    tools: dict
    settings: object  # hybridflow.agent.loop.AgentSettings
    default_loop: str
    prompt_length: int
    response_length: int

    @classmethod
    def from_config(cls, multi_turn: dict, prompt_length: int, response_length: int) -> "AgentRunner":
        from hybridflow.agent.loop import AgentSettings
        from hybridflow.agent.tools.config import load_tools
        from hybridflow.tiny import load_tokenizer

        tokenizer = load_tokenizer(multi_turn["tokenizer_path"])
        if multi_turn.get("chat_template"):
            tokenizer.chat_template = multi_turn["chat_template"]
        path = multi_turn.get("tool_config_path")
        settings = AgentSettings(
            max_assistant_turns=multi_turn.get("max_assistant_turns"),
            max_user_turns=multi_turn.get("max_user_turns"),
            max_parallel_calls=int(multi_turn.get("max_parallel_calls", 1)),
            max_tool_response_length=int(multi_turn.get("max_tool_response_length", 256)),
            tool_response_truncate_side=multi_turn.get("tool_response_truncate_side", "middle"),
            response_length=response_length,
            format=multi_turn.get("format", "hermes"),
            apply_chat_template_kwargs=dict(multi_turn.get("apply_chat_template_kwargs") or {}))
        return cls(tokenizer, load_tools(path) if path else {}, settings,
                   multi_turn.get("default_agent_loop", "single_turn_agent"), prompt_length, response_length)


def generate_agent_sequences(llm, runner: AgentRunner, prompts: DataProto, settings, pad_token_id: int,
                             context_length: int) -> DataProto:
    """The batch of ``settings.n`` trajectories per row of ``prompts`` (which carries the data's
    non-tensor columns: ``raw_prompt``, ``extra_info``, ``agent_name``, ...); ``settings``: the call's
    SamplingSettings (workers/rollout/base.py)."""
    rows = prompts.repeat(settings.n, interleave=True) if settings.n > 1 else prompts
    if "raw_prompt" not in rows.non_tensor_batch:
        raise ValueError("rollout.multi_turn: the batch has no raw_prompt column (the chat messages the agent loop "
                         "renders): pass the data's non-tensor columns to generate_sequences")
    sampling = dict(temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
                    max_tokens=settings.max_tokens)
    server = EngineTokenServer(llm, settings.stop_token_ids, settings.ignore_eos, context_length)
    # a call's max_tokens (meta_info) is the trajectories' response budget
    loop_settings = dataclasses.replace(runner.settings, response_length=settings.max_tokens)
    start = time.perf_counter()
    outputs = run_coroutine(_run_all(server, runner, loop_settings, rows, sampling))
    elapsed = time.perf_counter() - start
    out = assemble_batch(outputs, runner.prompt_length, runner.response_length, pad_token_id)
    out.meta_info = dict(prompts.meta_info)
    out.meta_info["metrics"] = {"perf/agent_engine_steps": float(server.steps),
                                "perf/agent_requests": float(server.requests),
                                "timing_s/agent_loops": elapsed}
    return out


def row_kwargs(rows: DataProto, i: int, request_id: str) -> dict:
    """The data row's non-tensor columns as the loop's keyword arguments, plus its request id."""
    kwargs = {name: column[i] for name, column in rows.non_tensor_batch.items()}
    kwargs["request_id"] = request_id
    return kwargs


async def _run_all(server: EngineTokenServer, runner: AgentRunner, loop_settings, rows: DataProto,
                   sampling: dict) -> list:
    from hybridflow.agent.registry import resolve_agent_loop

    names = rows.non_tensor_batch.get("agent_name")
    loops: dict[str, object] = {}

    def loop_of(i: int):
        # a row without a name (None, or a table's NaN) runs the default loop
        name = names[i] if names is not None and isinstance(names[i], str) and names[i] else runner.default_loop
        if name not in loops:
            loops[name] = resolve_agent_loop(name)(server, runner.tokenizer, loop_settings, runner.tools)
        return loops[name]

    done = asyncio.get_running_loop().create_future()
    driver = asyncio.ensure_future(server.drive(done))
    tasks = [asyncio.ensure_future(loop_of(i).run(dict(sampling), **row_kwargs(rows, i, f"traj-{i}")))
             for i in range(len(rows))]
    try:
        # a failing driver (engine error) ends the wait too, so nothing waits on a dead engine
        gathered = asyncio.gather(*tasks)
        await asyncio.wait([gathered, driver], return_when=asyncio.FIRST_COMPLETED)
        if driver.done() and not gathered.done():
            driver.result()  # raises the engine's error
        return gathered.result()
    finally:
        for task in tasks:
            task.cancel()
        if not done.done():
            done.set_result(None)  # the driver's wait ends
        server.abort_pending()
        await asyncio.gather(driver, *tasks, return_exceptions=True)


def run_coroutine(coro):
    """``asyncio.run(coro)``; in a thread of its own when this thread already runs an event loop
    (an async Ray actor)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def assemble_batch(outputs, prompt_length: int, response_length: int, pad_token_id: int) -> DataProto:
    """The rollout batch of ``AgentLoopOutput``s (module docstring); one line of error per broken row."""
    count = len(outputs)
    prompts = torch.full((count, prompt_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((count, prompt_length), dtype=torch.long)
    responses = torch.full((count, response_length), pad_token_id, dtype=torch.long)
    response_mask = torch.zeros((count, response_length), dtype=torch.long)
    response_real = torch.zeros((count, response_length), dtype=torch.long)
    log_probs = torch.zeros((count, response_length), dtype=torch.float32)
    tool_outputs = np.empty(count, dtype=object)
    for r, o in enumerate(outputs):
        p, k = len(o.prompt_ids), len(o.response_ids)
        if p > prompt_length:
            raise ValueError(f"rollout.multi_turn: trajectory {r}'s prompt is {p} tokens (the chat template with the "
                             f"tool schemas) > data.max_prompt_length={prompt_length}: raise data.max_prompt_length "
                             "(the data set's filter counts the prompt without the tool schemas)")
        if not 0 < p:
            raise ValueError(f"rollout.multi_turn: trajectory {r} has an empty prompt")
        if k > response_length:
            raise ValueError(f"rollout.multi_turn: trajectory {r} has {k} response tokens > data.max_response_length="
                             f"{response_length} (the agent loop must cut at its budget)")
        if not len(o.response_mask) == len(o.response_logprobs) == k:
            raise ValueError(f"rollout.multi_turn: trajectory {r}: {k} response ids, {len(o.response_mask)} mask "
                             f"values, {len(o.response_logprobs)} log-probs: the agent loop must give one of each")
        prompts[r, prompt_length - p:] = torch.tensor(o.prompt_ids, dtype=torch.long)
        prompt_mask[r, prompt_length - p:] = 1
        if k:
            responses[r, :k] = torch.tensor(o.response_ids, dtype=torch.long)
            response_mask[r, :k] = torch.tensor(o.response_mask, dtype=torch.long)
            response_real[r, :k] = 1
            log_probs[r, :k] = torch.tensor(o.response_logprobs, dtype=torch.float32) * response_mask[r, :k]
        tool_outputs[r] = list(o.extra_fields.get("tool_outputs", []))
    tensors = rl_batch_tensors(prompts, prompt_mask, responses, response_mask, log_probs, response_real)
    for column, metric in AGENT_COLUMNS.items():
        if metric == "num_turns":
            values = [float(o.num_turns) for o in outputs]
        else:
            values = [float(o.metrics.get(metric, 0.0)) for o in outputs]
        tensors[column] = torch.tensor(values, dtype=torch.float32)
    return DataProto.from_dict(tensors=tensors, non_tensors={TOOL_OUTPUTS: tool_outputs})

