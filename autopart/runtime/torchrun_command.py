"""The torchrun command that starts a plan's ranks, built here for every place that tells a user
what to run: compile's last lines, explain's, train.py's refusal of a launch of another size,
``build_stages``'s, and the docstrings of the generated files.

Ranks fill nodes of the plan's ``gpus_per_node`` in order, as the cost model placed them
(``cost_models.comm.nodes_spanned``): 6 ranks on nodes of 4 are a node of 4 and a node of 2.
On one node the command is torchrun's plainest. On nodes of one size every node runs the same
command, with torchrun's c10d rendezvous: the nodes are alike, so the order in which they join
(which numbers their ranks) does not matter. On nodes of unequal size each node is told its own
``--nproc-per-node``, and its ``--node-rank`` under the static rendezvous: torchrun numbers the
ranks node after node in rendezvous order, which only ``--node-rank`` fixes, so that the full
nodes hold the first ranks, as the plan was costed. A plan written before it recorded its nodes
(``gpus_per_node`` None) is told as one node.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.ir.plan import Plan

__all__ = ["Launch", "node_sizes", "plan_launch"]

_PORT = 29500  # torchrun's own default port: HOST:29500 is what its documentation shows


def node_sizes(world_size: int, gpus_per_node: int | None) -> tuple[int, ...]:
    """The ranks of each node, the nodes filled in order: ``(4, 2)`` for 6 ranks on nodes of 4."""
    if gpus_per_node is None or world_size <= gpus_per_node:
        return (world_size,)
    full, rest = divmod(world_size, gpus_per_node)
    return (gpus_per_node,) * full + ((rest,) if rest else ())


@dataclass(frozen=True, kw_only=True)
class Launch:
    """How to start ``train`` (a path, quoted for a shell) with ``args`` on nodes of ``sizes``
    ranks, as `node_sizes` gives them: full nodes, then the rest on the last one."""

    train: str
    sizes: tuple[int, ...]
    args: str = ""

    def lines(self) -> list[tuple[str, str]]:
        """(the nodes it is for, the command): one pair where every node runs the same command,
        else the full nodes' (``--node-rank R``) and the last node's. The first is "" on one node."""
        nodes, tail = len(self.sizes), f"{self.train}{' ' + self.args if self.args else ''}"
        if nodes == 1:
            return [("", f"torchrun --nproc-per-node {self.sizes[0]} {tail}")]
        if len(set(self.sizes)) == 1:
            return [(f"on each of the {nodes} nodes", f"torchrun --nnodes {nodes} --nproc-per-node {self.sizes[0]} "
                     f"--rdzv-backend c10d --rdzv-endpoint HOST:{_PORT} --rdzv-id autopart {tail}")]
        full = last = nodes - 1  # the full nodes, then the last one's rest

        def command(rank: str, size: int) -> str:
            return (f"torchrun --nnodes {nodes} --node-rank {rank} --nproc-per-node {size} --master-addr HOST "
                    f"--master-port {_PORT} {tail}")

        first = ("on node 0", command("0", self.sizes[0])) if full == 1 else \
            (f"on nodes 0 to {full - 1} (R: the node's number)", command("R", self.sizes[0]))
        return [first, (f"on node {last}", command(str(last), self.sizes[last]))]

    def where(self) -> str:
        """Whose address HOST is, where there is a HOST."""
        return "" if len(self.sizes) == 1 else " (HOST: the first node's address)"

    def one_line(self) -> str:
        """The commands on one line, as an error message gives them."""
        pairs = self.lines()
        if len(pairs) == 1 and not pairs[0][0]:
            return pairs[0][1]
        if len(pairs) == 1:
            return f"{pairs[0][1]} {pairs[0][0]}{self.where()}"
        return "; ".join(f"{nodes}: {command}" for nodes, command in pairs) + self.where()

    def block(self, indent: str = "  ", *, gap: bool = False) -> str:
        """The commands after a heading, one line each: ":\n  torchrun ..." on one node, else
        ", on each of the 2 nodes (HOST: ...):\n  torchrun ..." or a line per kind of node
        (``gap``: an empty line below the heading)."""
        pairs, below = self.lines(), "\n" if gap else ""
        if len(pairs) == 1:
            heading = f", {pairs[0][0]}{self.where()}" if pairs[0][0] else ""
            return f"{heading}:\n{below}{indent}{pairs[0][1]}"
        return f", on {len(self.sizes)} nodes{self.where()}:{below}" + "".join(
            f"\n{indent}{nodes}: {command}" for nodes, command in pairs)


def plan_launch(plan: Plan, train: str, args: str = "") -> Launch:
    """How to start ``plan``'s ranks on the nodes it was compiled for."""
    return Launch(train=train, sizes=node_sizes(plan.world_size, plan.gpus_per_node), args=args)
