"""fastpo.distributed: single-process mode, seeding and RNG state, group sharding, and 2 ranks under torchrun."""

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpo import distributed as du

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def single_process(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)


def test_single_process_has_no_process_group(single_process, capsys):
    info = du.init()
    assert (info.rank, info.world_size, info.local_rank) == (0, 1, 0)
    assert info.is_main and du.is_main() and not du.is_distributed()
    assert info.device == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    x = torch.tensor([1, 2])
    mean = du.all_reduce_mean(x)
    assert mean.dtype == torch.float32 and mean.tolist() == [1.0, 2.0]
    assert du.broadcast_object({"a": 1}) == {"a": 1}
    du.barrier()
    du.shutdown()
    assert du.init() == info


def test_shard_groups():
    assert du.shard_groups(8, 1, 0) == range(0, 8)
    assert [du.shard_groups(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    with pytest.raises(ValueError, match=r"env_groups \(6\).*world_size \(4\)"):
        du.shard_groups(6, 4, 0)
    with pytest.raises(ValueError, match="rank"):
        du.shard_groups(8, 2, 2)


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_seed_everything_per_rank():
    assert du.seed_everything(3, 0) == 3 and du.seed_everything(3, 2) == 3 + 2 * du.RANK_SEED_STRIDE
    du.seed_everything(3, 0)
    a = _draws()
    du.seed_everything(3, 0)
    assert _draws() == a
    du.seed_everything(3, 1)
    assert _draws() != a
    with pytest.raises(ValueError, match="seed"):
        du.seed_everything(-1)


def test_rng_state_round_trip_is_exact_and_json():
    du.seed_everything(7)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    random.gauss(0, 1)
    state = json.loads(json.dumps(du.rng_state()))
    expected = (*_draws(), np.random.randn(), random.gauss(0, 1))
    du.seed_everything(8)
    du.set_rng_state(state)
    assert (*_draws(), np.random.randn(), random.gauss(0, 1)) == expected


def test_set_deterministic(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # restored after the test
    try:
        du.set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        du.set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.slow
def test_two_ranks_under_torchrun(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "tests" / "dist_worker_distributed.py"),
        str(tmp_path),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun timed out:\n{err.decode()[-3000:]}")
    assert proc.returncode == 0, err.decode()[-3000:]
    assert out.decode().count("hello from rank 0 only") == 1  # fastpo.log: the main rank's console only
    assert sorted(line for line in err.decode().splitlines() if line.startswith("a warning from rank")) == [
        "a warning from rank 0", "a warning from rank 1"]  # extra=ALL_RANKS: every rank
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert (r0["rank"], r1["rank"], r0["world_size"], r1["local_rank"]) == (0, 1, 2, 1)
    assert r0["is_main"] and not r1["is_main"]
    assert r0["mean"] == r1["mean"] == [0.5, 5.0]
    assert r0["broadcast_rank"] == r1["broadcast_rank"] == 0
    assert (r0["groups"], r1["groups"]) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert r0["draw"] != r1["draw"]  # per-rank seeds
    assert r0["device"] == "cpu" or r0["device"].startswith("cuda")
