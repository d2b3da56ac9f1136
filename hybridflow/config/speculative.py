"""``actor_rollout_ref.rollout.speculative``: speculative decoding in the rollout (RLHFSpec).

vLLM verifies the drafts with the policy itself and its rejection sampler keeps the sampled
distribution the policy's, so the tokens and the log-probs the trainer compares with are the
policy's (greedy: the same tokens as without drafts). Draft sources (``method``):

- ``history``: n-gram look-up in the request's own prompt and answer, its sibling samples (the
  same prompt's other ``n``) and the answers the same prompt got in earlier steps (RL datasets are
  read epoch after epoch; HistoSpec's observation), workers/rollout/history_drafts.py;
- ``ngram``: vLLM's prompt look-up (the request's own tokens only);
- ``draft_model``: a small model of the same tokenizer at ``draft_model_path``; with
  ``parallel_drafting`` (PARD) the draft proposes all its tokens in one forward from mask tokens
  (its config names the mask: ``pard_token``, ``mask_token_id`` or ``ptd_token_id``), where a plain
  draft runs one forward per draft token.

``adaptive`` (workload-aware drafting, workers/rollout/adaptive_drafting.py) picks the number of
draft tokens per engine step, 0 (off) to ``num_speculative_tokens``, from the measured acceptance
and the measured cost of a verification step at the number of sequences running: drafting pays
in the long tail, when few sequences share a step, and costs throughput while many do.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hybridflow.config.keys import ARR, POSITIVE, Range, key

SPECULATIVE_METHODS = ("history", "ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    enable: bool = key(False, "speculative decoding in the rollout (rollout.name=vllm)")
    method: str = key("history", "history (prompt, sibling samples and earlier answers) | ngram (vLLM's prompt "
                                 "look-up) | draft_model", choices=SPECULATIVE_METHODS)
    num_speculative_tokens: int = key(4, "vLLM's name: the most draft tokens verified per sequence and step",
                                      Range(lambda v: 1 <= v <= 16, "in [1, 16]"))
    prompt_lookup_min: int = key(2, "vLLM's name: the shortest n-gram a draft is looked up by", POSITIVE)
    prompt_lookup_max: int = key(4, "vLLM's name: the longest n-gram a draft is looked up by (tried first)",
                                 POSITIVE)
    draft_model_path: str | None = key(None, "method=draft_model: the draft's HF checkpoint folder", path=True)
    parallel_drafting: bool = key(False, "vLLM's name; method=draft_model: the draft proposes every draft token in "
                                         "one forward (a PARD draft, trained with mask tokens; its config names "
                                         "the mask token)")
    adaptive: bool = key(True, "choose the draft tokens per step (0 = none) from measured acceptance and "
                               "verification cost; false: always num_speculative_tokens")
    retune_steps: int = key(16, "adaptive: engine steps between two choices of the drafts per batch size",
                            POSITIVE)
    history_answers: int = key(16, "method=history: finished answers kept per prompt as draft sources",
                               POSITIVE)
    history_prompts: int = key(8192, "method=history: prompts whose answers are kept (least recently drafted "
                                     "from are dropped first)", POSITIVE)


def speculative_errors(cfg) -> list[str]:
    """What ``rollout.speculative`` can run on, one line each (called by config/validate.py)."""
    r = cfg.actor_rollout_ref.rollout
    spec, errors = r.speculative, []
    if not spec.enable:
        return errors
    key = f"{ARR}.rollout.speculative"
    if r.name != "vllm":
        errors.append(f"{key}.enable=true uses vLLM's speculative decoding: set {ARR}.rollout.name=vllm, "
                      f"or {key}.enable=false")
    if spec.method == "draft_model" and not spec.draft_model_path:
        errors.append(f"{key}.method=draft_model needs the draft's checkpoint: set {key}.draft_model_path")
    elif spec.method == "draft_model" and not os.path.isdir(spec.draft_model_path):
        errors.append(f"{key}.draft_model_path={spec.draft_model_path} is not a folder: give the draft's HF "
                      "checkpoint folder")
    if spec.parallel_drafting:
        errors.extend(_parallel_drafting_errors(spec, key))
    if spec.prompt_lookup_min > spec.prompt_lookup_max:
        errors.append(f"{key}.prompt_lookup_min={spec.prompt_lookup_min} must be <= prompt_lookup_max="
                      f"{spec.prompt_lookup_max}: lower the first or raise the second")
    return errors


# where vLLM 0.32 reads a parallel draft's mask token from (its first match wins)
MASK_TOKEN_KEYS = ("pard_token", "mask_token_id", "ptd_token_id")


def _parallel_drafting_errors(spec, key: str) -> list[str]:
    if spec.method != "draft_model":
        return [f"{key}.parallel_drafting=true needs a trained parallel draft: set {key}.method=draft_model, or "
                f"{key}.parallel_drafting=false"]
    config = os.path.join(spec.draft_model_path or "", "config.json")
    if not os.path.isfile(config):
        return []  # the missing draft is reported above
    with open(config) as f:
        draft = json.load(f)
    if not any(isinstance(draft.get(name), int) for name in MASK_TOKEN_KEYS):
        return [f"{key}.parallel_drafting=true: the draft at {spec.draft_model_path} names no mask token "
                f"({' / '.join(MASK_TOKEN_KEYS)} in its config.json), so it was not trained for parallel "
                f"drafting: use a PARD draft, or {key}.parallel_drafting=false"]
    return []
