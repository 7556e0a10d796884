"""Suite-wide: the tests share two CPU cores, where torch's default of one OpenMP thread per core makes
small models many times slower. Set before torch is imported here, and inherited by every job the tests
start (subprocesses, Slurm tasks).

`pytest -n auto` (pytest-xdist, the README's test command) hands whole test files to its workers
(tests/file_scheduling.py), the Slurm jobs first: they are the longest chain of tests, and the cluster's own
processes run their tasks, so the other workers run the rest of the suite meanwhile.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels can only run interpreted here. Triton 3.6 reads this when it is first imported, and
    # transformers imports it early (through torch._dynamo), so it has to be set before any test module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # Its tl.dot without the machine's BLAS: a row's bits independent of the tile, as on a GPU (interpreted_dot.py).
    from interpreted_dot import install

    if not install():
        import warnings

        warnings.warn("interpreted_dot: no interpreter builder to patch; tl.dot runs on the BLAS", stacklevel=1)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") != "no" and not hasattr(config, "workerinput"):
        # Before any worker starts: jobs without a model.path, on every worker, load the default model, and
        # two of them must not both find it missing and create it at once.
        from batchjob.job.tiny_model import default_tiny_model

        default_tiny_model()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its collection order is the order work goes out
        items.sort(key=lambda item: item.get_closest_marker("slurm") is None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    from file_scheduling import FileScheduling

    return FileScheduling(config, log)
