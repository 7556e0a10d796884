"""The package's import graph: no module of batchjob imports itself through others, counting imports inside
functions and under `TYPE_CHECKING` (grimp reads every import statement). The layering itself is import-linter's
contracts in pyproject.toml (`lint-imports`)."""

import graphlib

import grimp
import pytest


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("batchjob", cache_dir=None)


def test_no_module_of_batchjob_imports_itself_through_others(graph: grimp.ImportGraph) -> None:
    order = graphlib.TopologicalSorter(
        {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    )
    try:
        order.prepare()
    except graphlib.CycleError as err:
        pytest.fail(f"import circle: {' -> '.join(err.args[1])}")


def test_a_circle_would_be_found() -> None:
    graph = grimp.build_graph("batchjob", cache_dir=None)
    graph.add_import(importer="batchjob.engine.native.scheduling.sequence", imported="batchjob.engine.native.engine")
    order = graphlib.TopologicalSorter(
        {module: graph.find_modules_directly_imported_by(module) for module in graph.modules}
    )
    with pytest.raises(graphlib.CycleError):
        order.prepare()


def test_the_native_engine_has_at_most_twelve_modules_at_its_root(graph: grimp.ImportGraph) -> None:
    root = [m for m in graph.find_children("batchjob.engine.native") if not graph.find_children(m)]
    assert len(root) <= 12, sorted(root)
