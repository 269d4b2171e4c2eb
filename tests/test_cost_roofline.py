"""The roofline model against hand computations from the spec figures, and the nccl-tests
communication formulas."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from cost_models import calibration
from cost_models.comm import (NodeSpan, bus_factor, fewest_members, node_span, node_steps, nodes_spanned,
                              tree_all_reduce_time)
from cost_models import CostModel, Kernel, KernelRecorder, RooflineCostModel, get_cost_model, load_device


def efficiency(spec, flops: float) -> float:
    """The spec's curve, interpolated here independently of DeviceSpec.matmul_efficiency_at."""
    xs, ys = zip(*spec.matmul_efficiency)
    return float(np.interp(math.log10(flops), xs, ys))


class Layer(nn.Module):
    """A GPT layer without biases, so that its matmuls are exactly the hand-counted ones."""

    def __init__(self, hidden: int, heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(hidden, dtype=dtype), nn.LayerNorm(hidden, dtype=dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=False, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.fc = nn.Linear(hidden, 4 * hidden, bias=False, dtype=dtype)
        self.fc_out = nn.Linear(4 * hidden, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(hidden, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(batch, seq, hidden))
        return x + self.fc_out(F.gelu(self.fc(self.ln_2(x))))


def test_gpt3_layer_forward_on_h100_equals_the_hand_computation() -> None:
    b, s, h, heads = 1, 2048, 12288, 96
    with FakeTensorMode():  # shapes only: the layer's 1.8e9 parameters are never allocated
        layer = Layer(h, heads, torch.bfloat16)
        x = torch.randn(b, s, h, dtype=torch.bfloat16)
        with torch.no_grad(), KernelRecorder() as recorder:
            layer(x)
    heavy = [k for k in recorder.kernels if k.category in ("matmul", "attention")]
    assert all(k.dtype == "bfloat16" for k in heavy)
    assert sum(k.flops for k in heavy) == 24 * b * s * h**2 + 4 * b * s**2 * h

    spec = load_device("h100-sxm")
    peak = spec.peak_flops["bfloat16"]
    assert peak == 989e12
    tokens = b * s
    by_hand = [  # (FLOPs, bytes) of qkv, attention, proj, fc, fc_out
        (2 * tokens * h * 3 * h, 2 * (tokens * h + 3 * h * h + tokens * 3 * h)),
        (4 * b * s * s * h, 2 * 4 * tokens * h + 4 * b * heads * s),  # q, k, v, out; fp32 logsumexp
        (2 * tokens * h * h, 2 * (tokens * h + h * h + tokens * h)),
        (2 * tokens * h * 4 * h, 2 * (tokens * h + 4 * h * h + tokens * 4 * h)),
        (2 * tokens * 4 * h * h, 2 * (tokens * 4 * h + 4 * h * h + tokens * h)),
    ]
    assert sorted((k.flops, k.bytes) for k in heavy) == sorted(by_hand)
    expected = 0.0
    for flops, nbytes in by_hand:
        compute = flops / (peak * efficiency(spec, flops))
        assert compute > nbytes / (spec.memory_bandwidth * spec.memory_efficiency)  # compute-bound
        expected += compute + spec.kernel_overhead_s
    model = RooflineCostModel(device=spec)
    assert model.kernels_time(heavy) == pytest.approx(expected, rel=1e-12)
    assert 0.010 < expected < 0.015  # ~7.6e12 FLOPs at ~690 TFLOP/s

    # the rest of the layer (norms, GELU, residuals) is bound by memory and adds a few percent
    total = model.kernels_time(recorder.kernels)
    assert expected < total < 1.15 * expected


def test_fp32_matmul_uses_the_fp32_peak_unless_the_spec_says_tf32() -> None:
    spec = load_device("h100-sxm")
    kernel = Kernel(op="aten.mm.default", category="matmul", flops=2e12, bytes=0.0, dtype="float32")
    fp32 = RooflineCostModel(device=spec).kernel_time(kernel)
    top = spec.matmul_efficiency[-1][1]  # 2e12 FLOPs lie past the curve's last point
    assert fp32 == pytest.approx(2e12 / (67e12 * top) + spec.kernel_overhead_s)
    tf32_spec = dataclasses.replace(spec, fp32_matmul_uses_tf32=True)
    tf32 = RooflineCostModel(device=tf32_spec).kernel_time(kernel)
    assert tf32 == pytest.approx(2e12 / (495e12 * top) + spec.kernel_overhead_s)


def test_memory_bound_kernels_and_views() -> None:
    spec = load_device("h200")
    model = RooflineCostModel(device=spec)
    add = Kernel(op="aten.add.Tensor", category="elementwise", flops=1e9, bytes=12e9, dtype="bfloat16")
    assert model.kernel_time(add) == pytest.approx(12e9 / (4.8e12 * 0.90) + spec.kernel_overhead_s)
    view = Kernel(op="aten.view.default", category="view", flops=0.0, bytes=0.0, dtype="bfloat16")
    assert model.kernel_time(view) == 0.0
    assert model.kernels_time([add, view, add]) == pytest.approx(2 * model.kernel_time(add))


def test_collectives_follow_nccl_tests_bus_bandwidth() -> None:
    spec = load_device("h100-sxm")
    model = get_cost_model("h100-sxm")
    assert isinstance(model, CostModel) and model.name == "roofline:h100-sxm"
    nbytes, n = 256e6, 8
    busbw = spec.intra_node_bandwidth * spec.link_efficiency
    step = spec.intra_node_latency_s
    assert model.collective_time("all_reduce", nbytes, n) == pytest.approx(
        2 * (n - 1) * step + nbytes * 2 * (n - 1) / n / busbw)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert model.collective_time(kind, nbytes, n) == pytest.approx(
            (n - 1) * step + nbytes * (n - 1) / n / busbw)
    assert model.collective_time("broadcast", nbytes, n) == pytest.approx((n - 1) * step + nbytes / busbw)
    across = model.collective_time("all_reduce", nbytes, n, nodes=n)
    assert across == pytest.approx(2 * (n - 1) * spec.inter_node_latency_s
                                   + nbytes * 2 * (n - 1) / n / (spec.inter_node_bandwidth * spec.link_efficiency))
    for kind in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"):
        assert model.collective_time(kind, nbytes, 1) == 0.0
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        model.collective_time("allreduce", nbytes, n)


def test_a_ring_over_nodes_pays_the_network_latency_only_where_it_crosses_a_node() -> None:
    """NCCL's tuning model: a ring of 512 ranks on 64 nodes of 8 crosses a node boundary 63 times
    an all-gather (126 an all-reduce); its other steps go over NVLink. The bytes cross between
    nodes through the 8 members' NICs at once."""
    spec = load_device("h100-sxm")
    model = get_cost_model("h100-sxm")
    nbytes, n, nodes = 4e8, 512, 64
    network = min(spec.intra_node_bandwidth, 8 * spec.inter_node_bandwidth) * spec.link_efficiency
    gather = model.collective_time("all_gather", nbytes, n, nodes=nodes)
    assert gather == pytest.approx(63 * spec.inter_node_latency_s + (511 - 63) * spec.intra_node_latency_s
                                   + nbytes * (n - 1) / n / network)
    ring = (126 * spec.inter_node_latency_s + (1022 - 126) * spec.intra_node_latency_s
            + nbytes * 2 * (n - 1) / n / network)
    tree = tree_all_reduce_time(nbytes, n, nodes=nodes, bus_bandwidth=network,
                                step_latency_s=spec.intra_node_latency_s, node_step_latency_s=spec.inter_node_latency_s)
    # the all-reduce is NCCL's faster algorithm: at 512 ranks the ring's 1,022 steps make it the tree
    assert tree < ring and model.collective_time("all_reduce", nbytes, n, nodes=nodes) == pytest.approx(tree)
    # latency-bound: each further node adds one network latency in place of an NVLink one
    small = [model.collective_time("all_gather", 0, n, nodes=k) for k in (2, 4, 64, 512)]
    assert small == sorted(small) and small[-1] - small[-2] == pytest.approx(
        448 * (spec.inter_node_latency_s - spec.intra_node_latency_s))
    with pytest.raises(ValueError, match="spans 1 to 8 nodes"):
        model.collective_time("all_gather", nbytes, 8, nodes=9)


def test_a_group_crosses_between_nodes_through_its_members_nics() -> None:
    """One member per node: one NIC's bus bandwidth; r members: r NICs', up to NVLink's. Eight
    H100s a node on eight NDR NICs come out within nccl-tests' published multi-node bus
    bandwidth, 400-450 GB/s for an all-reduce of 8 GB (Crusoe / Saturn Cloud's validation
    guide), less this spec's link efficiency, not at one NIC's 40-50 GB/s."""
    spec = load_device("h100-sxm")
    model = get_cost_model("h100-sxm")
    nbytes, nodes = 8e9, 16

    def bus_bandwidth(members: int, kind: str = "all_reduce") -> float:
        n = members * nodes
        # the ring's latency (an all-reduce's is twice an all-gather's), where an empty all-reduce is the tree's
        latency = (2 * model.collective_time("all_gather", 0, n, nodes=nodes) if kind == "all_reduce"
                   else model.collective_time(kind, 0, n, nodes=nodes))
        return nbytes * bus_factor(kind, n) / (model.collective_time(kind, nbytes, n, nodes=nodes) - latency)

    nic = spec.inter_node_bandwidth * spec.link_efficiency
    assert [bus_bandwidth(r) / nic for r in (1, 2, 4)] == pytest.approx([1, 2, 4])
    assert bus_bandwidth(8) == pytest.approx(min(8 * spec.inter_node_bandwidth, spec.intra_node_bandwidth)
                                             * spec.link_efficiency)
    assert 0.7 * 400e9 <= bus_bandwidth(8) <= 450e9
    assert bus_bandwidth(8, "all_to_all") == pytest.approx(nic)  # every rank's bytes through its own NIC


def test_nodes_spanned_follows_torchruns_placement() -> None:
    assert [nodes_spanned(8, 1, 8), nodes_spanned(16, 1, 8), nodes_spanned(4, 4, 8)] == [1, 2, 2]
    assert nodes_spanned(128, 1, 8) == 16  # ZeRO-3 over every GPU of 16 nodes
    assert nodes_spanned(16, 8, 8) == 16 and nodes_spanned(16, 16, 8) == 16  # one replica per node or more
    assert nodes_spanned(6, 1, 8) == 2  # the second group of six straddles two nodes
    # every axis of every mesh of up to 48 ranks, against the nodes of its groups' ranks
    for gpus in (4, 8):
        for dp, pp, tp in itertools.product(range(1, 7), range(1, 5), range(1, 7)):
            rank = lambda d, p, t: (d * pp + p) * tp + t  # autopart.runtime.mesh
            groups = {"tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
                      "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}
            spans = {axis: max(len({r // gpus for r in group}) for group in found) for axis, found in groups.items()}
            world = dp * pp * tp
            assert spans == {"tp": nodes_spanned(tp, 1, gpus, world), "dp": nodes_spanned(dp, pp * tp, gpus, world)}, \
                (dp, pp, tp, gpus)
    assert [node_steps("all_gather", 16, 2), node_steps("all_reduce", 16, 2), node_steps("all_to_all", 16, 2)] == [1, 2, 8]
    with pytest.raises(ValueError, match=">= 1"):
        nodes_spanned(4, 0, 8)


def test_fewest_members_follows_torchruns_placement() -> None:
    """Of an axis's groups that span several nodes, the fewest members one holds on a node: every
    axis of every mesh of up to 48 ranks, against the nodes of its groups' ranks."""
    for gpus in (4, 6, 8):
        for dp, pp, tp in itertools.product(range(1, 7), range(1, 5), range(1, 9)):
            rank = lambda d, p, t: (d * pp + p) * tp + t  # autopart.runtime.mesh
            groups = {"tp": [[rank(d, p, t) for t in range(tp)] for d in range(dp) for p in range(pp)],
                      "dp": [[rank(d, p, t) for d in range(dp)] for p in range(pp) for t in range(tp)]}
            fewest = {}
            for axis, found in groups.items():
                counts = [[sum(r // gpus == node for r in group) for node in {r // gpus for r in group}] for group in found]
                fewest[axis] = min((min(c) for c in counts if len(c) > 1), default=len(found[0]))
            world = dp * pp * tp
            assert fewest == {"tp": fewest_members(tp, 1, gpus, world), "dp": fewest_members(dp, pp * tp, gpus, world)}, \
                (dp, pp, tp, gpus)


def test_a_group_split_unevenly_across_nodes_crosses_at_the_nics_of_its_smaller_side() -> None:
    """TP 8 on nodes of 6 GPUs lies 6 + 2: every byte between its two nodes goes through the 2
    NICs of the node holding 2, not 4 as an even 4 + 4 split would give it. Even splits (nodes of
    4 or 8) are priced as before."""
    spec = load_device("h100-sxm")
    model = get_cost_model("h100-sxm")
    nbytes = 402.6e6  # one sequence-parallel all-gather of a GPT-3 layer at TP 8

    def on_two_nodes(nics: int) -> float:
        bandwidth = min(spec.intra_node_bandwidth, nics * spec.inter_node_bandwidth) * spec.link_efficiency
        return spec.inter_node_latency_s + 6 * spec.intra_node_latency_s + nbytes * 7 / 8 / bandwidth

    def gather(span: NodeSpan) -> float:
        return model.collective_time("all_gather", nbytes, 8, nodes=span.nodes, members=span.fewest)

    assert node_span(8, 1, 6, 8) == NodeSpan(nodes=2, fewest=2)
    assert gather(node_span(8, 1, 6, 8)) == pytest.approx(on_two_nodes(2))
    assert node_span(8, 1, 4, 8) == NodeSpan(nodes=2, fewest=4)  # 4 + 4: as an even split always was
    assert gather(node_span(8, 1, 4, 8)) == pytest.approx(on_two_nodes(4))
    assert gather(node_span(8, 1, 4, 8)) == model.collective_time("all_gather", nbytes, 8, nodes=2)
    assert gather(node_span(8, 1, 6, 8)) > 1.9 * gather(node_span(8, 1, 4, 8))
    assert node_span(16, 1, 12, 16) == NodeSpan(nodes=2, fewest=4)  # TP 16 on nodes of 12: 12 + 4
    assert node_span(12, 1, 8, 12) == NodeSpan(nodes=2, fewest=4)  # 12 replicas on nodes of 8: 8 + 4
    assert node_span(16, 4, 8, 64) == NodeSpan(nodes=8, fewest=2)  # whole nodes: 2 of each group a node
    assert node_span(8, 1, 8, 8) == NodeSpan(nodes=1, fewest=8)


def test_p2p_is_one_latency_plus_bytes_over_bandwidth() -> None:
    spec = load_device("a100-80gb")
    model = RooflineCostModel(device=spec)
    assert model.p2p_time(1e6) == pytest.approx(
        spec.intra_node_latency_s + 1e6 / (spec.intra_node_bandwidth * spec.link_efficiency))
    assert model.p2p_time(1e6, across_nodes=True) > model.p2p_time(1e6)
    assert model.p2p_time(0) == 0.0


def test_default_cost_model_is_this_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured rates become the spec (the measuring itself is tested in test_cost_devices)."""
    monkeypatch.setenv("AUTOPART_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibration, "_measure", lambda *, host, threads: calibration.CpuCalibration(
        host=host, torch_version=torch.__version__, threads=threads,
        matmul_rates=((2 * 64**3, 10e9), (2 * 1024**3, 100e9)), copy_bandwidth=20e9,
        kernel_overhead_s=4e-6, seconds_spent=0.5))
    model = get_cost_model()
    assert model.name == "roofline:cpu" and model.device.kind == "cpu"
    mm = Kernel(op="aten.mm.default", category="matmul", flops=2 * 1024**3, bytes=3 * 4 * 1024**2,
                dtype="float32")
    assert model.kernel_time(mm) == pytest.approx(2 * 1024**3 / 100e9 + 4e-6)
    small = dataclasses.replace(mm, flops=2 * 64**3, bytes=3 * 4 * 64**2)
    assert model.kernel_time(small) == pytest.approx(2 * 64**3 / 10e9 + 4e-6)  # 10 % of peak
    copy = Kernel(op="aten.copy_.default", category="copy", flops=0.0, bytes=1e9, dtype="float32")
    assert model.kernel_time(copy) == pytest.approx(1e9 / 20e9 + 4e-6)


def test_an_all_reduce_over_many_nodes_takes_ncclS_tree_where_it_is_faster() -> None:
    """NCCL's double binary tree: latency up and down a chain per node and log2(nodes) levels
    between nodes, the whole buffer at 0.92 of the ring's bus bandwidth (less for medium sizes,
    as NCCL corrects its own model). A data-parallel group of 512 replicas, one a node, reducing
    25 MB buckets would pay the ring's 1,022 network latencies (14 ms) a bucket; NCCL runs the tree."""
    spec = load_device("h100-sxm")
    model = get_cost_model("h100-sxm")
    nic = spec.inter_node_bandwidth * spec.link_efficiency
    latency = spec.inter_node_latency_s
    bucket = 25e6  # 64 B * 2**18 to 2**19: NCCL's 0.7
    assert model.collective_time("all_reduce", bucket, 512, nodes=512) == pytest.approx(
        2 * 9 * latency + 2 * bucket / (nic * 0.92 * 0.7))
    # eight members a node: a chain of seven NVLink steps each way besides the tree's levels
    assert tree_all_reduce_time(bucket, 512, nodes=64, bus_bandwidth=nic, step_latency_s=spec.intra_node_latency_s,
                                node_step_latency_s=latency) == pytest.approx(
        2 * (7 * spec.intra_node_latency_s + 6 * latency) + 2 * bucket / (nic * 0.92 * 0.7))
    # the ring where it is faster: few nodes and large messages, and always within a node
    ring = 2 * 3 * latency + 1e9 * 2 * 3 / 4 / nic
    assert model.collective_time("all_reduce", 1e9, 4, nodes=4) == pytest.approx(ring)
    # latency-bound small messages: from 64 to 512 replicas the tree adds 3 levels each way, the ring 896 steps
    small = [model.collective_time("all_reduce", 1e4, n, nodes=n) for n in (64, 512)]
    assert small[1] - small[0] == pytest.approx(2 * 3 * latency)
    assert tree_all_reduce_time(0, 1, nodes=1, bus_bandwidth=nic, step_latency_s=1e-6, node_step_latency_s=1e-5) == 0.0


@pytest.mark.parametrize("group, nodes", [(16, 2), (64, 8), (512, 64), (512, 512)])
def test_an_all_reduce_takes_no_less_time_on_more_bytes(group, nodes) -> None:
    """NCCL's size correction of the tree steps up at some sizes (0.7 to 0.8 at 64 MiB), where a
    byte more would take less time: the search's bounds, which time a rank's least bytes, count on
    time growing with bytes."""
    model = get_cost_model("h100-sxm")
    sizes = sorted({int(64 * 2 ** (k / 16)) for k in range(16 * 26)} | {(64 << k) + d for k in range(24) for d in (-1, 0)})
    times = [model.collective_time("all_reduce", size, group, nodes=nodes) for size in sizes]
    assert all(a <= b for a, b in zip(times, times[1:]))


def test_gloo_has_no_tree() -> None:
    """A CPU's collectives (gloo) run as rings across nodes too."""
    cpu = get_cost_model("cpu")
    spec = cpu.device
    ring = (2 * 15 * spec.inter_node_latency_s
            + 1e4 * 2 * 15 / 16 / (min(spec.intra_node_bandwidth, spec.inter_node_bandwidth) * spec.link_efficiency))
    assert cpu.collective_time("all_reduce", 1e4, 16, nodes=16) == pytest.approx(ring)
