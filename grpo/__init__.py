"""GRPO-family RL fine-tuning on DeepSpeed. The Python API (grpo/api.py), imported on first use so that the
package's modules load light:

    from grpo import train, make_config, RunResult
"""

import importlib
from typing import Any

from grpo.foundation.console import quiet_libraries

quiet_libraries()  # before DeepSpeed's import: its "Setting accelerator to CPU" notice, once per process
__all__ = ["train", "make_config", "RunResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:  # at the first use, not when a module of the package is imported (that would load them all)
        return getattr(importlib.import_module("grpo.api"), name)
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")
