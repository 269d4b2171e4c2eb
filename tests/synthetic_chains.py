"""Small synthetic cost tables and clusters for the search and baseline tests (no capture, no device)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from autopart.solve.search import Cluster
from autopart.solve.chain_costs import ChainCosts


@dataclass(frozen=True, kw_only=True)
class SyntheticTable:
    """An embedding block, ``layers`` layers of two blocks each, a head block; costs scale with
    the micro-batch size and split evenly over tensor-parallel ranks (plus a fixed TP overhead)."""

    forward_s: tuple[float, ...]  # per block, one sample, tp = 1
    saved_bytes: tuple[int, ...]  # per block, one sample
    parameter_bytes: tuple[int, ...]  # per block
    boundary_bytes: int  # per sample, after every block
    tied: bool = False  # the head reads the embedding's weight
    tp_overhead: float = 0.1  # each split op costs this fraction more per tp > 1
    layered: bool = False  # the layers' parameters are their own (FSDP units at ZeRO-3, ``autopart.predict.memory``)
    frozen: frozenset[str] = frozenset()  # parameters (``w<block>``) the model does not train
    frozen_prefix: int = 0  # blocks whose boundaries after them no gradient crosses (nothing trained before them)

    @property
    def layers(self) -> list[str | None]:
        inner = len(self.forward_s) - 2
        return [None, *(f"h.{k // 2}" for k in range(inner)), None]

    def layer_spans(self) -> tuple[tuple[int, int], ...]:
        """Each layer's blocks (first, end): two, or one where the blocks between the embedding
        and the head are odd in number."""
        names = self.layers
        starts = [k for k, name in enumerate(names) if name is not None and (k == 0 or names[k - 1] != name)]
        return tuple((k, next((j for j in range(k, len(names)) if names[j] != names[k]), len(names))) for k in starts)

    def block_parameters(self) -> tuple[tuple[str, ...], ...]:
        names = [(f"w{k}",) for k in range(len(self.forward_s))]
        if self.tied:
            names[-1] = ("w0",)
        return tuple(names)

    def chain_costs(self, *, micro_batch_size: int, tp: int, dtype: str) -> ChainCosts:
        scale = micro_batch_size / tp * (1 + (self.tp_overhead if tp > 1 else 0.0))
        forward = tuple(f * scale for f in self.forward_s)
        saved = tuple(s * micro_batch_size // tp for s in self.saved_bytes)
        names = self.block_parameters()
        parameter_bytes = {n[0]: max(1, self.parameter_bytes[k] // tp) for k, n in enumerate(names) if n[0] == f"w{k}"}
        layers: dict[str, list[str]] = {}
        for layer, block in zip(self.layers, names):
            if layer is not None and self.layered:
                layers.setdefault(layer, []).extend(block)
        return ChainCosts(
            forward_s=forward,
            backward_s=tuple(2 * f for f in forward),
            weight_s=forward,
            saved_bytes=saved,
            selective_saved_bytes=tuple(s // 2 for s in saved),
            selective_recompute_s=tuple(f / 4 for f in forward),
            weight_seed_bytes=tuple(s // 3 for s in saved),  # what a split backward keeps from I to W
            boundary_bytes=(self.boundary_bytes * micro_batch_size,) * (len(forward) - 1),
            input_bytes=8 * micro_batch_size,
            parameter_bytes=parameter_bytes,
            parameter_state_bytes=dict(parameter_bytes),
            block_parameters=names,
            layer_parameters=frozenset(p for ps in layers.values() for p in ps),
            layer_bytes=max((sum(parameter_bytes[p] for p in ps) for ps in layers.values()), default=0),
            layer_spans=self.layer_spans(),  # what full recompute checkpoints one by one
            frozen_parameters=self.frozen & frozenset(parameter_bytes),
            boundary_gradients=tuple(k >= self.frozen_prefix for k in range(len(forward) - 1)) if self.frozen_prefix
            else (),
        )

    def state_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32", layered: bool = False,
                    frozen: bool = False) -> int:
        """fp32 Adam: weights, gradients and two moments; ZeRO-1 shards the moments, ZeRO-2/3
        everything beside a whole copy of weights and gradients, which a layer's own unit at
        ZeRO-3 holds only in flight (``autopart.predict.memory``). The synthetic layouts are fp32:
        ``dtype`` is taken as the real tables take it, and unused. A frozen parameter: its weights
        alone, sharded at ZeRO-3 where it is a layer's own."""
        if frozen:
            return parameter_bytes // dp if zero == 3 and layered else parameter_bytes
        if zero == 3 and layered:
            return 4 * parameter_bytes // dp
        if zero in (2, 3):
            return 2 * parameter_bytes + 4 * parameter_bytes // dp
        return 2 * parameter_bytes + (2 * parameter_bytes // dp if zero else 2 * parameter_bytes)

    def owned_bytes(self, parameter_bytes: int, *, dp: int, zero: int, dtype: str = "fp32", frozen: bool = False) -> int:
        """The two moments, which ZeRO-1 leaves whole to each tensor's owner (`state_bytes`); a
        frozen parameter has none."""
        return 2 * parameter_bytes if zero == 1 and dp > 1 and not frozen else 0


def random_table(rng: random.Random, *, layers: int, tied: bool | None = None) -> SyntheticTable:
    blocks = 2 * layers + 2
    forward = [rng.uniform(0.5, 2.0) for _ in range(blocks)]
    forward[0] = rng.uniform(0.01, 0.2)  # an embedding is cheap, a head may be expensive
    forward[-1] = rng.uniform(0.2, 4.0)
    return SyntheticTable(
        forward_s=tuple(forward),
        saved_bytes=tuple(rng.randrange(50, 400) for _ in range(blocks)),
        parameter_bytes=tuple(rng.randrange(100, 2_000) for _ in range(blocks)),
        boundary_bytes=rng.randrange(1, 40),
        tied=rng.random() < 0.5 if tied is None else tied,
    )


def cluster(*, memory_bytes: int, gpus_per_node: int, bandwidth: float = 1_000.0, across: float = 100.0,
            latency_s: float = 1e-3, optimizer_s_per_byte: float = 1e-4) -> Cluster:
    def link(is_across: bool) -> float:
        return across if is_across else bandwidth

    return Cluster(
        memory_bytes=memory_bytes,
        overhead_bytes=memory_bytes // 50,
        gpus_per_node=gpus_per_node,
        p2p_s=lambda nbytes, is_across: nbytes / link(is_across) + latency_s,
        all_reduce_s=lambda nbytes, group, span: 2 * (group - 1) / group * nbytes / link(span.nodes > 1) + latency_s,
        all_gather_s=lambda nbytes, group, span: (group - 1) / group * nbytes / link(span.nodes > 1) + latency_s,
        optimizer_s_per_byte=optimizer_s_per_byte,
    )
