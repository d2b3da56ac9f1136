"""Multi-turn, tool-using rollouts (issue 37): per-trajectory agent loops over a token server.

Pure python plus a transformers tokenizer: no vLLM, no workers. The rollout worker supplies a
``TokenServer`` (loop.py) and runs one ``AgentLoopBase.run`` per trajectory concurrently.
"""
