"""Export a saved actor (or critic) as an ordinary HF checkpoint (safetensors + config + tokenizer).

    python scripts/export_hf.py <checkpoint> <out_dir> [--role actor|critic] [--external-lib MODULE]

``<checkpoint>`` is a ``global_step_N`` folder, its ``actor/`` or ``critic/`` folder, or a run's
``trainer.default_local_dir`` (its latest complete checkpoint). It runs in one process, with no
cluster of the saved shape; see ``workers/export.py`` for how FSDP and Megatron shards are read.
"""
import sys

from workers.export import main

if __name__ == "__main__":
    sys.exit(main())
