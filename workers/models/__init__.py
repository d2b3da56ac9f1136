"""Llama/Qwen2-family models built from megatron-core tensor-parallel layers (see layout.py)."""
