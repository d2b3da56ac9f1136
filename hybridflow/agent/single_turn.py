"""``single_turn_agent``: one generation from the prompt, no tools (verl's SingleTurnAgentLoop).

The loop for rows without tool use inside a multi-turn rollout (a row's ``agent_name`` column picks
it). The prompt is templated without tool schemas: a loop that cannot run tools should not offer
them to the model.
"""
from __future__ import annotations

from hybridflow.agent.chat import prompt_ids
from hybridflow.agent.loop import AgentLoopBase, AgentLoopOutput, zero_metrics


class SingleTurnAgentLoop(AgentLoopBase):
    async def run(self, sampling_params: dict, **row) -> AgentLoopOutput:
        prompt = prompt_ids(self.tokenizer, row["raw_prompt"], None, self.settings.apply_chat_template_kwargs)
        out = await self.generate(f"{row['request_id']}-0", prompt, sampling_params, self.settings.response_length)
        metrics = zero_metrics()
        metrics.update(num_turns=2.0, generated_tokens=float(len(out.token_ids)))  # verl counts the prompt turn
        return AgentLoopOutput(prompt_ids=prompt, response_ids=out.token_ids, response_mask=[1] * len(out.token_ids),
                               response_logprobs=out.log_probs, num_turns=2, metrics=metrics,
                               extra_fields={"tool_outputs": [], "tool_rewards": [], "stop_reason": "single_turn"})
