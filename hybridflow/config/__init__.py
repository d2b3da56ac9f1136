"""Typed configuration of a hybridflow run (verl's key tree), loaded from Hydra and validated
before any worker starts. Each section is a dataclass in this package (``RootConfig``'s fields);
``recipes/cli.py`` composes the recipes' YAML into the tree ``load_config`` reads.

    cfg = load_config(hydra_cfg)          # unknown keys / wrong types -> ConfigError
    validate(cfg, available_slots=4)      # sizes, names, files, devices -> ConfigError
    d = derive(cfg, dataset_len=len(ds))  # dp sizes, mini-batches per step, total steps
"""
from hybridflow.config.derived import Derived, derive
from hybridflow.config.errors import ConfigError
from hybridflow.config.keys import dotted_keys
from hybridflow.config.load import load_config
from hybridflow.config.root import RootConfig
from hybridflow.config.validate import validate
from hybridflow.model_checks import read_model_config

__all__ = ["ConfigError", "Derived", "RootConfig", "derive", "dotted_keys", "load_config", "read_model_config",
           "validate"]
