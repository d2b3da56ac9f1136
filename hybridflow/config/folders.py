"""Moved to hybridflow/host_checks.py; sft.py imports it from here until it imports that."""
from hybridflow.host_checks import writable_folder_error  # noqa: F401
