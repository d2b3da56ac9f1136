"""Prompt data sets (parquet/jsonl, verl's schema), the resumable loader, the arithmetic and counting tasks."""
from hybridflow.data.arithmetic import ArithmeticTaskConfig, generate_arithmetic, write_arithmetic_parquet
from hybridflow.data.count import CountTaskConfig, generate_count, write_count_parquet
from hybridflow.data.dataset import DataError, RLPromptDataset, encode_prompt, left_pad, prompt_text, read_rows
from hybridflow.data.loader import ResumablePromptLoader, collate_prompts

__all__ = [
    "ArithmeticTaskConfig", "generate_arithmetic", "write_arithmetic_parquet",
    "CountTaskConfig", "generate_count", "write_count_parquet",
    "DataError", "RLPromptDataset", "encode_prompt", "left_pad", "prompt_text", "read_rows",
    "ResumablePromptLoader", "collate_prompts",
]
