"""What a run prints, and what it keeps other libraries from printing (issue 60 item 11: a progress bar and one line
per logged step, nothing glued onto the bar, no library chatter).

``say`` prints a line above the progress bar when one is on screen (tqdm's ``write``: the bar is cleared, the line
printed, the bar drawn again), else a plain line. ``quiet_libraries`` (called once per process, at import of the
package's entry points) drops DeepSpeed's "Setting accelerator to CPU" notice (the run names its device itself);
``no_save_bars`` keeps transformers' "Writing model shards" bars off the console while a checkpoint is written,
``no_dataset_bars`` the datasets library's "Generating train split" while a local file is read.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from typing import Iterator

_CHATTER = ("Setting accelerator to CPU",)  # DeepSpeed's, once per process at its import


def say(message: str, err: bool = False) -> None:
    """One line on stdout (or stderr), above the progress bar when one is drawn."""
    stream = sys.stderr if err else sys.stdout
    bars = _live_bars()
    if bars:
        from tqdm import tqdm

        tqdm.write(message, file=stream)
    else:
        print(message, file=stream, flush=True)


def _live_bars() -> bool:
    tqdm_module = sys.modules.get("tqdm.std")
    instances = getattr(getattr(tqdm_module, "tqdm", None), "_instances", None)
    return bool(instances)


class _DropChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in _CHATTER)


def quiet_libraries() -> None:
    """Filter DeepSpeed's logger before DeepSpeed makes it (its factory fetches the same logger by name and keeps
    the filter). Idempotent."""
    ds = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _DropChatter) for f in ds.filters):
        ds.addFilter(_DropChatter())


@contextlib.contextmanager
def no_save_bars() -> Iterator[None]:
    """transformers' progress bars off while the block runs (a checkpoint's save_pretrained draws one per shard
    file), as they were after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def no_dataset_bars() -> Iterator[None]:
    """The datasets library's progress bars off while the block runs, as they were after."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was:
            datasets.enable_progress_bars()
