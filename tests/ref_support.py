"""Helpers shared by the reference-server tests (tests/test_ref_*.py)."""

from __future__ import annotations

import json
import random
import socket
import threading
from pathlib import Path

import pytest
import torch

from grpo.foundation.logprobs import Packed, pack


def ragged_batch(seed: int, rows: int, vocab: int, max_prompt: int = 20, max_completion: int = 12,
                 width: int | None = None) -> Packed:
    """Rows of random lengths (some completions empty) padded like the trainer's batches."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(4, vocab) for _ in range(rng.randint(1, max_prompt))] for _ in range(rows)]
    completions = [[rng.randrange(4, vocab) for _ in range(rng.randint(0, max_completion))] for _ in range(rows)]
    return pack(prompts, completions, pad_id=0, width=width or max_completion)


def log_events(path: Path, event: str = "request") -> list[dict]:
    """The server's JSON access-log lines of one event kind."""
    out = []
    for line in Path(path).read_text(errors="replace").splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            if rec.get("event") == event:
                out.append(rec)
    return out


class RecordingServer:
    """The Reference protocol's admin side, answered the way a reference server answers it (reloads recorded)."""

    def __init__(self):
        self.version, self.loaded = 0, []

    def info(self) -> dict:
        return {"version": self.version}

    def reload(self, checkpoint_dir: str) -> dict:
        self.loaded.append(checkpoint_dir)
        self.version += 1
        return self.info()


def trickle_headers(sock: socket.socket, stop: threading.Event, every_s: float) -> threading.Thread:
    """A started thread sending one header byte on ``sock`` every ``every_s`` seconds (at most 1000) until ``stop``
    or the server closes it: each read is quick, the headers never end."""

    def send() -> None:
        for _ in range(1000):
            if stop.wait(every_s):
                return
            try:
                sock.send(b"X")
            except OSError:
                return

    sender = threading.Thread(target=send)
    sender.start()
    return sender


def assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    assert torch.equal(a, b), f"max abs difference {(a - b).abs().max().item()}"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Autouse where imported (the server tests): the server runs with OMP_NUM_THREADS=1 and CPU kernels split
    large reductions by thread count, so bit-exact comparisons need the in-process side on one thread too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
