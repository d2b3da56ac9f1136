"""How the trainer reads a multi-turn batch (hybridflow/trajectory.py and its callers): the reward
decodes the whole trajectory, tool responses included, and gets the tool texts in extra_info; the
outcome score sits on the last generated token (advantages ignore tool tokens); the step's agent/*
metrics; a single-turn batch reads exactly as before."""
import numpy as np
import torch

from hybridflow.protocol import DataProto
from hybridflow.rewards.manager import RewardManager
from hybridflow.tiny import make_char_tokenizer
from hybridflow.trainer.generations import generation_rows
from hybridflow.trainer.metrics import data_metrics
from hybridflow.trainer.reward_process import score_batch
from hybridflow.trajectory import AGENT_COLUMNS, agent_step_metrics, last_generated_index, reward_columns
from workers.rollout.vllm_agent import assemble_batch
from hybridflow.agent.loop import AgentLoopOutput

TOK = make_char_tokenizer()
P, R = 6, 40


def _ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def _trajectory(prompt, turns, metrics=None):
    """An AgentLoopOutput from (text, generated?) pieces."""
    ids, mask, outputs = [], [], []
    for text, generated in turns:
        ids += _ids(text)
        mask += [int(generated)] * len(_ids(text))
        if not generated:
            outputs.append(text)
    return AgentLoopOutput(prompt_ids=_ids(prompt), response_ids=ids, response_mask=mask,
                           response_logprobs=[-0.5 if m else 0.0 for m in mask], num_turns=1 + len(turns),
                           metrics={"tool_calls": len(outputs), "tool_errors": 1.0, **(metrics or {}),
                                    "generated_tokens": float(sum(mask)), "tool_tokens": float(len(mask) - sum(mask))},
                           extra_fields={"tool_outputs": outputs})


def _batch():
    rows = [_trajectory("2*3=", [("calc", True), ("[6]", False), ("6", True)]),
            _trajectory("9-1=", [("calc", True), ("[8] and a very long tool text", False)], {"tool_timeouts": 1.0})]
    out = assemble_batch(rows, P, R, pad_token_id=0)
    out.non_tensor_batch.update(data_source=np.array(["t", "t"], dtype=object),
                                ground_truth=np.array(["6", "8"], dtype=object),
                                extra_info=np.array([{"k": 1}, {"k": 1}], dtype=object))
    return out


def test_the_assembled_batch_keeps_the_loops_ids_masks_and_log_probs():
    b = _batch().batch
    assert TOK.decode(b["prompts"][0][b["attention_mask"][0, :P].bool()].tolist()) == "2*3="
    assert TOK.decode(b["responses"][0][b["attention_mask"][0, P:].bool()].tolist()) == "calc[6]6"
    assert b["response_mask"][0, :8].tolist() == [1, 1, 1, 1, 0, 0, 0, 1] and not b["response_mask"][0, 8:].any()
    assert (b["rollout_log_probs"][b["response_mask"] == 0] == 0).all()
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], 1))
    assert b["position_ids"][0, P:P + 8].tolist() == list(range(4, 12))  # counts real tokens, tool ones too
    assert b["agent_num_turns"].tolist() == [4.0, 3.0] and b["agent_tool_tokens"].tolist() == [3.0, 29.0]


def test_a_prompt_longer_than_the_prompt_length_fails_naming_the_key():
    long = _trajectory("x" * (P + 1), [("a", True)])
    try:
        assemble_batch([long], P, R, 0)
    except ValueError as err:
        assert "data.max_prompt_length" in str(err) and "tool schemas" in str(err)
    else:
        raise AssertionError("an overlong prompt was accepted")


def test_the_reward_reads_the_whole_trajectory_and_the_tool_outputs():
    seen = []

    def score(data_source, solution_str, ground_truth, extra_info):
        seen.append((solution_str, extra_info))
        return 1.0

    batch = _batch()
    token_scores, scores, _, _, texts = score_batch(TOK, RewardManager(score), batch)
    assert texts == ["calc[6]6", "calc[8] and a very long tool text"]
    assert seen[0][1] == {"k": 1, "tool_outputs": ["[6]"]} and seen[1][1]["tool_outputs"] == ["[8] and a very long tool text"]
    assert batch.non_tensor_batch["extra_info"][0] == {"k": 1}  # the shared row dicts are not changed
    # the score sits on the last generated token, even where the trajectory ends on tool tokens
    last = last_generated_index(batch.batch["response_mask"]).tolist()
    assert last == [7, 3] and token_scores[1, 3] == 1.0 and token_scores.sum().item() == 2.0
    assert set(reward_columns(batch.batch)) == {"responses", "response_mask", "attention_mask", "agent_num_turns"}
    rows = generation_rows(batch, scores, TOK)
    assert rows[0]["output"] == "calc[6]6"


def test_agent_metrics_of_a_step():
    b = _batch()
    b.batch["token_level_scores"] = b.batch["token_level_rewards"] = torch.zeros(2, R)
    b.batch["advantages"] = b.batch["returns"] = torch.zeros(2, R)
    m = data_metrics(b, use_critic=False)
    assert m["agent/num_turns/mean"] == 3.5 and m["agent/tool_calls/mean"] == 1.0
    assert m["agent/tool_errors"] == 2.0 and m["agent/tool_timeouts"] == 1.0 and m["agent/parse_failures"] == 0.0
    assert m["agent/generated_tokens/mean"] == 4.5
    # response_length is the whole trajectory (verl's), the generated part is agent/generated_tokens
    assert m["response_length/mean"] == m["agent/generated_tokens/mean"] + m["agent/tool_tokens/mean"]
    assert set(AGENT_COLUMNS) <= set(b.batch.keys())


def test_a_single_turn_batch_reads_as_before():
    mask = torch.tensor([[1, 1, 1, 0]])
    single = DataProto.from_dict({"responses": torch.tensor([[5, 6, 7, 0]]), "response_mask": mask,
                                  "attention_mask": torch.ones(1, 8, dtype=torch.long)})
    assert agent_step_metrics(single.batch) == {}
    assert reward_columns(single.batch) == ["responses", "response_mask"]


def test_the_data_path_carries_the_chat_and_agent_name_to_the_rollout(tmp_path):
    import json

    from hybridflow.data.dataset import RLPromptDataset
    from hybridflow.data.loader import collate_prompts
    from hybridflow.trainer.async_rollout import generation_request

    rows = [{"prompt": [{"role": "user", "content": "1+1="}], "reward_model": {"ground_truth": "2"},
             "data_source": "t", "agent_name": "tool_agent"},
            {"prompt": [{"role": "user", "content": "2+2="}], "reward_model": {"ground_truth": "4"}, "data_source": "t"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    ds = RLPromptDataset(str(path), TOK, max_prompt_length=16, apply_chat_template=False)
    batch = DataProto.from_single_dict(collate_prompts([ds[0], ds[1]]))
    assert list(batch.non_tensor_batch["agent_name"]) == ["tool_agent", None]  # None: agent.default_agent_loop
    request = generation_request(batch, True, n=2)
    assert request.non_tensor_batch["raw_prompt"][1] == rows[1]["prompt"] and request.meta_info["n"] == 2
    assert generation_request(batch, n=2).non_tensor_batch == {}  # single-turn requests stay tensors only
