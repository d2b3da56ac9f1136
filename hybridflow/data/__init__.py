"""Prompt data sets (parquet/jsonl, verl's schema), the resumable loader and the arithmetic task."""
from hybridflow.data.arithmetic import ArithmeticTaskConfig, generate_arithmetic, write_arithmetic_parquet
from hybridflow.data.dataset import DataError, RLPromptDataset, encode_prompt, left_pad, prompt_text, read_rows
from hybridflow.data.loader import ResumablePromptLoader, collate_prompts

__all__ = [
    "ArithmeticTaskConfig", "generate_arithmetic", "write_arithmetic_parquet",
    "DataError", "RLPromptDataset", "encode_prompt", "left_pad", "prompt_text", "read_rows",
    "ResumablePromptLoader", "collate_prompts",
]
