"""Multi-node runs on localhost and failing ranks: the real entry point under torchrun.

Two "nodes" are two torchrun launchers (``--nnodes=2 --node_rank=0/1``, 1 process each, static rendezvous on
127.0.0.1), each started in its own folder with the same relative ``--trainer.run_dir``: two node-local disks that
do not see each other's files. A stalled rank is a worker stopped with SIGSTOP.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastpo.testing import run_killable

TINY = ["--preset", "tiny", "--env.max_turns", "2", "--rollout.response_length", "16", "--env.val_groups", "4",
        "--env.env_groups", "4", "--env.group_size", "4", "--optim.mini_batch_size", "8",
        "--optim.micro_batch_tokens", "800", "--rollout.max_model_len", "800", "--trainer.val_every", "0",
        "--trainer.val_before_train", "false", "--trainer.save_every", "1"]
# CPU ranks: built at import, before tests/conftest.py hides GPUs per test, so the pin is explicit here (2 ranks on a
# 1-GPU machine would otherwise pick nccl and set_device(1))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "CUDA_VISIBLE_DEVICES": ""}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path: Path, args: list[str], node1_extra: tuple[str, ...] = (), timeout: float = 240):
    """Launch both nodes at once; returns [(exit code, stdout, stderr)] for node 0 and node 1."""
    port = _free_port()
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir(exist_ok=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=1",
               "--master_addr=127.0.0.1", f"--master_port={port}", "-m", "fastpo.train", *TINY, *args,
               "--trainer.run_dir", "run", *(node1_extra if node else ())]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      start_new_session=True))
    results, deadline = [], time.monotonic() + timeout
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append((p.returncode, out.decode(), err.decode()))
    except subprocess.TimeoutExpired:
        pytest.fail(f"two-node run timed out after {timeout}s")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    return results


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp-" in p.name or ".disk-probe-" in p.name)


@pytest.mark.slow
def test_two_nodes_with_node_local_run_dirs_train_and_resume(tmp_path):
    """Each node keeps a complete, identical copy of every checkpoint on its own disk and resumes from it."""
    for rc, out, err in _two_nodes(tmp_path, ["--trainer.iterations", "1"]):
        assert rc == 0, (out + err)[-4000:]
    results = _two_nodes(tmp_path, ["--trainer.iterations", "2"])
    for rc, out, err in results:
        assert rc == 0, (out + err)[-4000:]
    assert "resumed from step 1" in results[0][1]
    for step in ("step-000001", "step-000002"):
        markers = [json.loads((tmp_path / f"node{n}" / "run" / "checkpoints" / step / "COMPLETE").read_text())
                   for n in (0, 1)]
        assert markers[0] == markers[1]
        assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "rng-rank-00001.json"} <= set(markers[0]["files"])
    from fastpo import checkpoint

    for n in (0, 1):
        assert checkpoint.verify(tmp_path / f"node{n}" / "run" / "checkpoints" / "step-000002") is None
    assert _leftovers(tmp_path) == []
    rows = [json.loads(line) for line in (tmp_path / "node0" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "node0" / "run" / "hf" / "COMPLETE").is_file()  # rank 0 exports on its own disk


@pytest.mark.slow
def test_nodes_started_with_different_run_dirs_are_refused(tmp_path):
    results = _two_nodes(tmp_path, ["--trainer.iterations", "1"], ("--trainer.run_dir", "elsewhere"), timeout=120)
    # torchrun exits 1 when a worker fails; the worker's own status (2: bad input) is in its failure summary
    assert [rc for rc, _, _ in results] == [1, 1], [(out + err)[-2000:] for _, out, err in results]
    assert all(re.search(r"exitcode\s*: 2 ", err) for _, _, err in results)
    err = results[0][2]
    assert "different trainer.run_dir or configs" in err and "'run'" in err and "'elsewhere'" in err
    assert not (tmp_path / "node0" / "run" / "checkpoints").exists()


def _worker_pids(launcher_pid: int) -> dict[int, int]:
    """RANK -> pid of torchrun's worker processes (children of the launcher)."""
    out = {}
    for d in Path("/proc").iterdir():
        try:
            if not d.name.isdigit() or int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(d.name)
    return out


def _alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_stalled_rank_fails_the_job_with_a_message(tmp_path):
    """SIGSTOP rank 1 mid-run: rank 0's next collective times out after trainer.collective_timeout_s and the job
    exits non-zero with a message, well before torch's 30-minute default."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "fastpo.train",
           *TINY, "--trainer.iterations", "100", "--trainer.save_every", "0", "--trainer.collective_timeout_s", "10",
           "--trainer.run_dir", str(run)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not reach step 1"
            time.sleep(0.5)
        pids = _worker_pids(proc.pid)
        os.kill(pids[1], signal.SIGSTOP)
        stopped = time.monotonic()
        # A hung rank dies on torchrun's SIGTERM; a stopped one would hold it pending, and torchrun would wait 30 s
        # more before its SIGKILL. So once rank 0 has failed, rank 1 is let go: it then takes the pending SIGTERM.
        while _alive(pids[0]) and time.monotonic() - stopped < 120:
            time.sleep(0.2)
        os.kill(pids[1], signal.SIGCONT)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    err = err.decode()
    assert proc.returncode != 0
    assert "training stopped (rank 0): a collective timed out after 10 s (trainer.collective_timeout_s)" in err, \
        err[-3000:]
    assert time.monotonic() - stopped < 120


@pytest.mark.slow
def test_bad_collective_timeout_is_a_config_error(tmp_path):
    rc, _, err = run_killable([sys.executable, "-m", "fastpo.train", *TINY, "--trainer.collective_timeout_s", "0",
                               "--trainer.run_dir", str(tmp_path / "run")], tmp_path, ENV, 120)
    assert rc == 2 and "trainer.collective_timeout_s must be > 0 and finite, got 0" in err


def _raised_in(path: str, err: BaseException) -> BaseException:
    """``err`` raised by code whose file is ``path`` (its traceback's innermost frame), as torch's collectives raise
    gloo's errors (plain RuntimeErrors) from torch/distributed/distributed_c10d.py."""
    try:
        exec(compile("raise ERR", path, "exec"), {"ERR": err})  # a one-line raise, attributed to `path`
    except BaseException as raised:
        return raised
    raise AssertionError("not raised")


def test_collective_failure_messages():
    import torch.distributed

    from fastpo.distributed import collective_failure

    c10d = os.path.join(os.path.dirname(torch.distributed.__file__), "distributed_c10d.py")
    gloo = _raised_in(c10d, RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv "
                                         "operation to complete"))
    assert collective_failure(gloo, 5).startswith("a collective timed out after 5 s (trainer.collective_timeout_s)")
    peer = _raised_in(c10d, RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"))
    assert collective_failure(peer, 5).startswith("another rank died or closed its connection")
    assert collective_failure(_raised_in(c10d, RuntimeError("CUDA out of memory")), 5) is None
    # FSDP2's gathers: the error comes out of torch's custom-op layer, below a torch.distributed frame (the stalled
    # rank test once hit this: a traceback instead of the line)
    library = os.path.join(os.path.dirname(torch.__file__), "_library", "autograd.py")
    fsdp = os.path.join(os.path.dirname(torch.distributed.__file__), "fsdp", "_fully_shard", "_fsdp_param_group.py")
    timeout = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation")
    exec(compile("def gather():\n    raise ERR\n", library, "exec"), scope := {"ERR": timeout})
    with pytest.raises(RuntimeError) as raised:
        exec(compile("gather()", fsdp, "exec"), scope)
    assert collective_failure(raised.value, 10).startswith("a collective timed out after 10 s")
    assert collective_failure(_raised_in(library, RuntimeError("Timed out waiting 5000ms")), 5) is None  # no dist frame
    nccl = torch.distributed.DistBackendError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7)")
    assert collective_failure(nccl, 5).startswith("a collective timed out")  # by its type, raised anywhere


@pytest.mark.parametrize("text", ["backend timed out", "Connection reset by peer", "Timed out waiting 5000ms"])
def test_a_message_alone_does_not_make_a_collective_failure(text, tmp_path):
    """Only an error raised by torch.distributed (its collectives' frames, or a DistError) is a stalled or lost rank:
    a plug-in's, a library's or fastpo's own RuntimeError saying "timed out" was reported as one, even in one
    process."""
    from fastpo.distributed import collective_failure

    for err in (RuntimeError(text), _raised_in(str(tmp_path / "my_envs.py"), RuntimeError(text))):
        assert collective_failure(err, 5) is None, err


def test_exit_status_reraises_a_timed_out_error_that_is_no_collective(capsys):
    """One process: a RuntimeError saying "timed out" from outside torch.distributed is a bug (its traceback), not
    "training stopped (rank 0): a collective timed out"; a TextEnvError saying it stays one env error line."""
    import torch

    from fastpo.distributed import DistInfo
    from fastpo.envs.text import TextEnvError
    from fastpo.train import _exit_status

    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    err = RuntimeError("backend timed out")
    with pytest.raises(RuntimeError, match="backend timed out"):
        _exit_status(err, info, None, 300)
    env = TextEnvError("boom", 0, "step", 10000, "RuntimeError: backend timed out")
    assert _exit_status(env, info, None, 300) == 1
    assert capsys.readouterr().err.splitlines() == [
        "env error: text env 'boom' instance 0 (seed 10000) failed in step: RuntimeError: backend timed out"]


def test_another_ranks_failure_is_one_line_on_this_rank(monkeypatch, capsys):
    """A step every rank takes together (``storage.agree``: the prompt check, checkpoint writes) failed on rank 0,
    e.g. a plug-in's reset: rank 1 stops with one line naming rank 0's error; its words ("timed out") used to make it
    a stalled collective, and any other words a traceback."""
    import torch

    from fastpo import storage
    from fastpo.distributed import DistInfo
    from fastpo.train import _exit_status

    theirs = ("TextEnvError", "text env 'boom' instance 0 (seed 5) failed in reset: RuntimeError: backend timed out",
              False)
    monkeypatch.setattr(storage, "all_gather_object", lambda mine: [theirs, mine])
    with pytest.raises(storage.RankFailedError) as err:
        storage.agree(lambda: None)
    info = DistInfo(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    assert _exit_status(err.value, info, None, 300) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"training stopped (rank 1): rank 0 failed: {theirs[0]}: {theirs[1]}"]


def test_ranks_with_different_resume_or_overwrite_are_refused_before_any_check(monkeypatch, tmp_path):
    """resume / overwrite are outside the config hash, but they decide whether a rank refuses the run dir or goes on
    to the next collective. Ranks that disagree are refused together (probe defect 5), not left waiting."""
    from fastpo import storage
    from fastpo.config import ConfigError

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')  # a started run: rank 0 alone would refuse it
    for other in (("auto", True), ("never", False)):
        peer = (str(tmp_path), "h", *other)
        monkeypatch.setattr(storage, "all_gather_object", lambda obj, peer=peer: [obj, peer])
        with pytest.raises(ConfigError, match=r"trainer.resume and trainer.overwrite included.*rank 0: run_dir "
                                              r".*resume 'auto', overwrite False.*rank 1: .*resume '" + other[0]):
            storage.claim_run_dir(tmp_path, "auto", False, config_hash="h")


@pytest.mark.slow
def test_nodes_started_with_different_overwrite_are_refused_on_every_rank(tmp_path):
    """Node 0's disk holds a started run: alone, node 0 would refuse it and node 1 (overwrite) would wait for it in
    the next collective until the timeout. Both exit 2 with one message, and nothing is deleted."""
    started = tmp_path / "node0" / "run" / "metrics.jsonl"
    started.parent.mkdir(parents=True)
    started.write_text('{"step": 1}\n')
    results = _two_nodes(tmp_path, ["--trainer.iterations", "1", "--trainer.collective_timeout_s", "60"],
                         ("--trainer.overwrite", "true"), timeout=120)
    assert [rc for rc, _, _ in results] == [1, 1], [(out + err)[-2000:] for _, out, err in results]
    assert all(re.search(r"exitcode\s*: 2 ", err) for _, _, err in results)
    assert "trainer.resume and trainer.overwrite included" in results[0][2] and "overwrite True" in results[0][2]
    assert started.read_text() == '{"step": 1}\n'
