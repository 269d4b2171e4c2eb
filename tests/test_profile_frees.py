"""What the profiler copies of the model is freed as it returns, also with the cycle collector
off, as a compile runs (`autopart.profiling.profile.profile_costs`): a GraphModule and its Graph
refer to each other, so nothing but the collector frees one."""

import gc

from torch import fx

from autopart.ir.model_file import load_model_file
from autopart.passes.capture import capture
from autopart.profiling.profile import profile_costs
from cost_models.database import CostDatabase
from tests.test_measure_defaults import MODEL


def _graph_modules() -> int:
    return sum(isinstance(thing, fx.GraphModule) for thing in gc.get_objects())


def test_the_profilers_copies_are_gone_as_it_returns_with_the_collector_off(tmp_path) -> None:
    spec = load_model_file(MODEL)
    graph = capture(spec, batch_size=2)
    database = CostDatabase.load(tmp_path / "costs.json")
    was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        before = _graph_modules()
        profile_costs(graph, spec, database, micro_batch_size=2, in_situ_seconds=0.05)
        after = _graph_modules()
    finally:
        if was_on:
            gc.enable()
    assert database.timed > 0  # it profiled, and so copied the graph to time it
    assert after == before
