"""Where the programs' random numbers come from: one seed per forward, a function of train.py's
``--seed`` and the forward's place in training, drawn alike by every rank that must draw alike."""

from __future__ import annotations

import hashlib

__all__ = ["draw_seed"]


def draw_seed(seed: int, *parts: int) -> int:
    """The generator's seed for one forward: a function of train.py's ``--seed`` and where the forward
    sits (step, replica, microbatch, stage), so that what a model draws (dropout) depends on
    neither the schedule's order nor the process: a rerun and a resumed run draw the same, every
    tensor-parallel rank of a stage draws alike (a replicated activation stays one tensor; a split
    one draws each slice from a stream of its own, `autopart.runtime.collectives.sharded_dropout`),
    and a recomputing stage draws as one that keeps its activations."""
    digest = hashlib.blake2b("/".join(map(str, (seed, *parts))).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # 63 bits: no two forwards of a long run share one
