"""Checkpoints without DeepSpeed (a stand-in engine): saving the latest step again survives a crash between
its renames, everything is fsynced before ``latest`` moves, and the trainer state never runs pickled code."""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo.training import checkpoint
from grpo.training.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint


class _Module:
    def state_dict(self):
        return {"w": torch.zeros(2)}

    def save_pretrained(self, folder, state_dict=None, safe_serialization=True):
        Path(folder, "model.safetensors").write_bytes(b"weights")
        Path(folder, "config.json").write_text("{}")


class _Engine:
    """The calls checkpoint.py makes on a DeepSpeed engine."""

    module = _Module()

    def zero_optimization_partition_weights(self):
        return False

    def save_checkpoint(self, path, tag):
        Path(path, tag).mkdir(parents=True, exist_ok=True)
        Path(path, tag, "optim_states.pt").write_bytes(b"optimizer")

    def load_checkpoint(self, path, tag):
        return (path, {}) if Path(path, tag, "optim_states.pt").is_file() else (None, None)


class _Tokenizer:
    def save_pretrained(self, folder):
        Path(folder, "tokenizer.json").write_text("{}")


def save(out, step, **extra):
    return save_checkpoint(_Engine(), _Tokenizer(), out, step, {"step": step, "sampler": {"consumed": 8 * step}, **extra})


def assert_complete(path, step):
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    assert (path / "ds" / "optim_states.pt").is_file()
    state = load_checkpoint(_Engine(), path)
    assert state["step"] == step and state["sampler"] == {"consumed": 8 * step}


def test_a_crash_while_saving_the_latest_step_again_leaves_latest_resolving(tmp_path, monkeypatch):
    save(tmp_path, 3)
    assert latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-3"
    real_replace = os.replace

    def crash_on_the_rename_in(src, dst):  # the new step-3 is finished; the process dies before it is in place
        if Path(src).name == ".tmp-step-3":
            raise KeyboardInterrupt("simulated crash between the old folder's removal and the rename")
        return real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", crash_on_the_rename_in)
    with pytest.raises(KeyboardInterrupt):
        save(tmp_path, 3)  # e.g. a finished run resumed: it saves its last step again
    monkeypatch.setattr(checkpoint.os, "replace", real_replace)
    found = latest_checkpoint(tmp_path)
    assert found is not None, "latest points at nothing"
    assert_complete(found, 3)
    # the next save puts the new folder in place and clears the aside copy
    assert save(tmp_path, 3) == latest_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step-3"
    assert_complete(tmp_path / "checkpoints" / "step-3", 3)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step-3"]


def test_every_file_and_folder_is_fsynced_before_latest_is_written(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))),
                                                            real_fsync(fd))[1])
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (events.append(("replace", str(a), str(b))),
                                                                real_replace(a, b))[1])
    final = save(tmp_path, 2)
    root = tmp_path / "checkpoints"
    latest_at = next(i for i, e in enumerate(events) if e[0] == "replace" and e[2] == str(root / "latest"))
    synced = {e[1] for e in events[:latest_at] if e[0] == "fsync"}
    tmp = root / ".tmp-step-2"
    for p in [final, *final.rglob("*")]:
        assert str(tmp / p.relative_to(final)) in synced, p
    assert str(root) in synced  # the folder holding the renamed step
    # the marker is a symlink: its target is written with the link itself (a folder entry), which the
    # folder's fsync after the rename makes durable together with the rename
    assert events[latest_at][1] == str(root / ".latest.tmp")
    assert ("fsync", str(root)) in events[latest_at:]


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))  # runs on unpickling


def test_a_trainer_state_with_pickled_code_is_refused(tmp_path):
    final = save(tmp_path, 1)
    marker = tmp_path / "code-ran"
    torch.save({"step": 1, "sampler": {}, "rng": rng_state(), "algo": _Evil(marker)}, final / "trainer" / "rank0.pt")
    with pytest.raises(RuntimeError, match=r"rank0.pt holds objects other than tensors and plain data.*refusing"):
        load_checkpoint(_Engine(), final)
    assert not marker.exists()


def test_rng_state_round_trips_and_an_older_ndarray_state_still_loads(tmp_path):
    final = save(tmp_path, 1)
    first = (torch.rand(3), random.random(), np.random.rand(3), np.random.randn())
    load_checkpoint(_Engine(), final)  # back to the state saved above
    second = (torch.rand(3), random.random(), np.random.rand(3), np.random.randn())
    torch.testing.assert_close(first[0], second[0])
    assert first[1] == second[1] and np.array_equal(first[2], second[2]) and first[3] == second[3]
    # a trainer state written before RNG states were stored as tensors: numpy's state is a tuple with an ndarray
    legacy = {**rng_state(), "numpy": np.random.get_state()}
    torch.save({"step": 1, "sampler": {"consumed": 8}, "rng": legacy}, final / "trainer" / "rank0.pt")
    expected = np.random.rand(2)
    np.random.seed(123)
    assert load_checkpoint(_Engine(), final)["step"] == 1
    assert np.array_equal(np.random.rand(2), expected)


def test_latest_is_a_relative_symlink_and_the_text_file_form_still_reads(tmp_path):
    from grpo.foundation.modeling import resolve_model_path

    save(tmp_path, 1)
    save(tmp_path, 2)
    root = tmp_path / "checkpoints"
    assert (root / "latest").is_symlink() and os.readlink(root / "latest") == "step-2"
    assert (root / "latest" / "config.json").is_file()  # loads like the folder itself
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]  # no temporary link left
    for given in (root / "latest", root, tmp_path):
        assert resolve_model_path(str(given)) == str(root / "step-2")
    (root / "latest").unlink()
    (root / "latest").write_text("step-1\n")  # what runs wrote before the symlink
    assert latest_checkpoint(tmp_path) == root / "step-1"
    assert resolve_model_path(str(root / "latest")) == str(root / "step-1")
    save(tmp_path, 3)  # the text file is replaced by the link
    assert os.readlink(root / "latest") == "step-3" and latest_checkpoint(tmp_path) == root / "step-3"
    assert resolve_model_path(str(root / "step-1")) == str(root / "step-1")  # a step folder is itself
    adapter = root / "step-4"  # a LoRA run's step folder: no config.json, and DeepSpeed's own ``latest``
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "latest").write_text("ds")
    assert resolve_model_path(str(adapter)) == str(adapter)


def test_a_latest_naming_a_missing_folder_is_a_clear_error(tmp_path):
    from grpo.foundation.config import ConfigError
    from grpo.foundation.modeling import resolve_model_path

    save(tmp_path, 1)
    root = tmp_path / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").symlink_to("step-9")
    with pytest.raises(ConfigError, match="step folder that does not exist"):
        resolve_model_path(str(root / "latest"))


def test_keep_checkpoints_never_deletes_the_folder_latest_names(tmp_path):
    for step in (5, 6, 7):
        save(tmp_path, step)
    # a run restarted in the same folder without --resume: its first checkpoints are older-numbered
    save_checkpoint(_Engine(), _Tokenizer(), tmp_path, 1, {"step": 1, "sampler": {"consumed": 8}}, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-1", "step-7"]
    assert latest_checkpoint(tmp_path) == root / "step-1"
    save_checkpoint(_Engine(), _Tokenizer(), tmp_path, 2, {"step": 2, "sampler": {"consumed": 16}}, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-2"]


def test_reference_folders_no_checkpoint_names_are_deleted(tmp_path):
    """ref.sync_every wrote a whole model folder per sync and never deleted one (issue 30, item 9): only the
    reference in use and the folders the remaining checkpoints would resume from are kept."""
    from grpo.training.checkpoint import prune_reference_folders

    ref = tmp_path / "reference"
    for n in (2, 4, 6, 8):
        (ref / f"step-{n}").mkdir(parents=True)
    for step, folder in ((5, ref / "step-4"), (7, ref / "step-6")):
        (tmp_path / "checkpoints" / f"step-{step}" / "trainer").mkdir(parents=True)
        torch.save({"step": step, "reference": {"folder": str(folder), "version": 1}},
                   tmp_path / "checkpoints" / f"step-{step}" / "trainer" / "rank0.pt")
    removed = prune_reference_folders(tmp_path, str(ref / "step-8"))
    assert sorted(p.name for p in removed) == ["step-2"]
    assert sorted(p.name for p in ref.iterdir()) == ["step-4", "step-6", "step-8"]
    # a checkpoint whose state cannot be read: nothing is deleted
    (tmp_path / "checkpoints" / "step-9" / "trainer").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step-9" / "trainer" / "rank0.pt").write_bytes(b"not a torch file")
    assert prune_reference_folders(tmp_path, None) == [] and len(list(ref.iterdir())) == 3


def test_a_copied_run_folder_still_resumes_from_its_latest_step(tmp_path):
    """Issue 42, item 16: shutil.copytree, cp -L or a bucket sync turn ``latest`` into a folder, and --resume
    said "no checkpoint"."""
    import shutil

    from grpo.foundation.modeling import resolve_model_path

    run = tmp_path / "run"
    save(run, 1)
    save(run, 3)
    save(run, 2)  # a restart in the same folder: latest is step-2, not the newest number
    copy = tmp_path / "copy"
    shutil.copytree(run, copy, symlinks=False)
    root = copy / "checkpoints"
    assert (root / "latest").is_dir() and not (root / "latest").is_symlink()
    assert latest_checkpoint(copy) == root / "step-2"
    assert resolve_model_path(str(root / "latest")) == resolve_model_path(str(copy)) == str(root / "step-2")
    assert load_checkpoint(_Engine(), latest_checkpoint(copy))["step"] == 2
    save(copy, 4)  # the next save puts the link back; the copied folder is kept aside, not deleted
    assert os.readlink(root / "latest") == "step-4" and (root / ".old-latest-copy" / "config.json").is_file()
