"""``actor_rollout_ref.rollout.speculative``: speculative decoding in the rollout (RLHFSpec), through vLLM's own speculative decoding; placeholder, filled in by issue 35."""
from __future__ import annotations

from dataclasses import dataclass

from hybridflow.config.keys import key


@dataclass
class SpeculativeConfig:
    enable: bool = key(False, "speculative decoding in the rollout")
