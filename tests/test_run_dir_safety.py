"""The run directory is never lost or shared by mistake: every check runs before trainer.overwrite deletes anything,
resume=auto does not replace a finished run it cannot continue, one trainer per run directory (a lock), stale
temporary folders of killed writes are removed at start-up, a successful run exports once, and a huge
trainer.collective_timeout_s reaches the process group without overflowing (docs/OPERATIONS.md, probe table 13)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fastpo import storage
from fastpo.config import ConfigError
from fastpo.config_load import parse_args
from fastpo.preflight import validate
from fastpo.storage import LOCK_FILE, claim_run_dir, lock_run_dir
from fastpo.testing import run_killable
from fastpo.tiny_agent import tiny_agent_path

TINY = ["--preset", "tiny"]
# a run small enough to train in a few seconds in-process
SMALL = [*TINY, "--env.max_turns", "1", "--rollout.response_length", "8", "--env.val_groups", "2",
         "--env.env_groups", "2", "--env.group_size", "2", "--optim.mini_batch_size", "2",
         "--optim.micro_batch_tokens", "800", "--rollout.max_model_len", "800", "--trainer.val_every", "0",
         "--trainer.val_before_train", "false", "--trainer.iterations", "1"]
# CPU ranks: built at import, before tests/conftest.py hides GPUs per test, so the pin is explicit here (2 ranks on a
# 1-GPU machine would otherwise pick nccl and set_device(1))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
       "CUDA_VISIBLE_DEVICES": ""}


@pytest.fixture
def work(tmp_path, monkeypatch):
    """A scratch folder as cwd (not the repo root: there ./kernels shadows the HF kernels probe, see test_trainer)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _finished_run(run: Path, checkpoints: bool = False, model_in_hf: bool = False) -> None:
    """What a finished run leaves (without training one): rows, an export, a report, optionally a checkpoint."""
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}\n")
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
    if model_in_hf:
        shutil.copytree(tiny_agent_path(), run / "hf")
    else:
        (run / "hf").mkdir()
        (run / "hf" / "model.safetensors").write_bytes(b"weights")
    (run / "report.txt").write_text("success before / after\n")
    if checkpoints:
        (run / "checkpoints" / "step-000001").mkdir(parents=True)
        (run / "checkpoints" / "step-000001" / "COMPLETE").write_text("{}")


def _snapshot(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _main(args: list[str]) -> int:
    from fastpo.train import main

    return main(args)


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("config error:")]


# ----------------------------------------------------------------------- 1. a successful run exports once
@pytest.mark.slow
def test_a_successful_run_exports_once_and_close_is_idempotent(work, monkeypatch, capsys):
    from fastpo import checkpoint
    from fastpo.trainer import Trainer

    exports, closes = [], []
    real_export, real_close = checkpoint.export_hf, Trainer.close

    def export_hf(*args, **kwargs):
        exports.append(args[2])
        return real_export(*args, **kwargs)

    def close(self, *args, **kwargs):
        closes.append(self)
        return real_close(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "export_hf", export_hf)
    monkeypatch.setattr(Trainer, "close", close)
    run = work / "run"
    assert _main([*SMALL, "--trainer.run_dir", str(run)]) == 0, capsys.readouterr().err[-3000:]
    assert exports == [run / "hf"] and len(closes) == 1  # train.py closes once
    closes[0].close()  # a second close does nothing: no second save, gather or export
    assert exports == [run / "hf"]
    assert (run / "hf" / "COMPLETE").is_file() and not (run / LOCK_FILE).exists()  # the lock is released


# ------------------------------------------------------------ 2. every check runs before overwrite deletes
def test_overwrite_deletes_nothing_when_the_prompt_check_refuses(work, capsys):
    """The prompt check needs the tokenizer (it ran after the deletion): exit 2 and the old run intact."""
    run = work / "run"
    _finished_run(run, checkpoints=True)
    before = _snapshot(run)
    rc = _main([*TINY, "--rollout.max_model_len", "100", "--trainer.run_dir", str(run), "--trainer.resume", "never",
                "--trainer.overwrite", "true"])
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert len(_error_lines(err)) == 1 and "rollout.max_model_len (100) is too short" in err, err[-3000:]
    assert _snapshot(run) == before and not (run / LOCK_FILE).exists()


def test_overwrite_refuses_a_model_inside_the_run_it_would_delete(work, capsys):
    run = work / "run"
    _finished_run(run, checkpoints=True, model_in_hf=True)
    before = _snapshot(run)
    rc = _main([*TINY, "--model.path", str(run / "hf"), "--trainer.run_dir", str(run), "--trainer.resume", "never",
                "--trainer.overwrite", "true"])
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    lines = _error_lines(err)
    assert len(lines) == 1 and f"model.path {str(run / 'hf')!r} lies inside" in lines[0], err[-3000:]
    assert "trainer.overwrite would delete" in lines[0] and "another trainer.run_dir" in lines[0]
    assert _snapshot(run) == before
    # the same under resume=auto + overwrite over a run without checkpoints; a model elsewhere is fine
    shutil.rmtree(run / "checkpoints")
    with pytest.raises(ConfigError, match="model.critic_path .* lies inside"):
        claim_run_dir(run, "auto", True, model_paths={"model.path": "tiny", "model.critic_path": str(run / "hf")})
    assert _snapshot(run) == {k: v for k, v in before.items() if not k.startswith("checkpoints")}
    claim_run_dir(run, "never", True, model_paths={"model.path": str(tiny_agent_path())})
    assert not (run / "hf").exists()


# ------------------------------------------------- 3. resume=auto does not replace a run it cannot continue
def test_resume_auto_refuses_a_finished_run_without_checkpoints(work, capsys):
    run = work / "run"
    _finished_run(run)
    before = _snapshot(run)
    with pytest.raises(ConfigError) as info:
        claim_run_dir(run, "auto", False)
    message = str(info.value)
    assert f"trainer.run_dir {str(run)!r}" in message and "no checkpoint to continue it from" in message
    assert "--trainer.overwrite true" in message and "choose another trainer.run_dir" in message
    assert _snapshot(run) == before
    rc = _main([*TINY, "--trainer.run_dir", str(run)])  # through the entry point: exit 2, one line, nothing touched
    err = capsys.readouterr().err
    assert rc == 2 and len(_error_lines(err)) == 1 and "no checkpoint to continue it from" in err, err[-3000:]
    assert _snapshot(run) == before
    claim_run_dir(run, "auto", True)  # overwrite asked: the old run goes, a fresh one starts
    assert sorted(p.name for p in run.iterdir()) == ["config.json"]
    assert "trainer.overwrite: deleted the previous run" in capsys.readouterr().out


def test_resume_auto_still_continues_or_starts_where_nothing_is_lost(work):
    run = work / "run"
    _finished_run(run, checkpoints=True)
    claim_run_dir(run, "auto", False)  # a checkpoint to continue from
    fresh = work / "fresh"
    fresh.mkdir()
    (fresh / "metrics.jsonl").write_text("\n")  # no row: nothing started
    (fresh / "run_info.json").write_text("{}")  # a launch that died while loading
    claim_run_dir(fresh, "auto", False)
    assert (fresh / "metrics.jsonl").exists() and (fresh / "run_info.json").exists()


# ---------------------------------------------------------------- 4. stale temporary folders at start-up
def test_start_up_removes_stale_temporary_folders(work, capsys):
    from fastpo.startup import prepare_run_dir

    run = work / "run"
    _finished_run(run, checkpoints=True)
    stale = [run / "hf.tmp-4242", run / "checkpoints" / "step-000007.tmp-4242",
             run / "checkpoints" / "step-000001.tmp-77"]
    for d in stale:
        d.mkdir()
        (d / "half.safetensors").write_bytes(b"\0" * 10)
    keep = run / "checkpoints" / "step-000001"
    cfg = validate(parse_args([*TINY, "--trainer.run_dir", str(run)]), 1)
    lock = prepare_run_dir(cfg)
    try:
        assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()  # held while the run writes
        out = capsys.readouterr().out
        assert not any(d.exists() for d in stale) and (keep / "COMPLETE").is_file()
        removed = [line for line in out.splitlines() if line.startswith("removed the stale temporary folder")]
        assert sorted(removed) == sorted(f"removed the stale temporary folder {d} (an unfinished write of pid "
                                         f"{d.name.rsplit('-', 1)[1]}, which no longer holds this run directory)"
                                         for d in stale), out
    finally:
        lock.release()
    assert not (run / LOCK_FILE).exists()


# ----------------------------------------------------------------------------- 5. one trainer per run dir
def test_lock_is_exclusive_and_released(work):
    run = work / "run"
    lock = lock_run_dir(run)
    record = json.loads((run / LOCK_FILE).read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid() and record["started"]
    with pytest.raises(ConfigError) as info:  # another open of the file (another trainer) cannot take it
        lock_run_dir(run)
    assert f"host {socket.gethostname()!r}, pid {os.getpid()}" in str(info.value)
    assert "in use by another trainer" in str(info.value)
    lock.release()
    lock.release()  # idempotent
    assert not (run / LOCK_FILE).exists()
    lock_run_dir(run).release()


def test_a_second_trainer_on_a_locked_run_dir_exits_2_and_writes_nothing(work, capsys):
    run = work / "run"
    _finished_run(run, checkpoints=True)
    (run / "hf.tmp-99").mkdir()  # the holder's export in flight: not touched either
    lock = lock_run_dir(run)
    try:
        before = _snapshot(run)
        rc = _main([*SMALL, "--trainer.run_dir", str(run), "--trainer.resume", "never", "--trainer.overwrite", "true"])
        err = capsys.readouterr().err
        assert rc == 2, err[-3000:]
        lines = _error_lines(err)
        assert len(lines) == 1 and f"host {socket.gethostname()!r}, pid {os.getpid()}" in lines[0], err[-3000:]
        assert _snapshot(run) == before and (run / "hf.tmp-99").is_dir()
    finally:
        lock.release()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()  # reaped: the pid runs nothing now
    return proc.pid


def test_stale_lock_is_taken_over_and_another_hosts_is_refused(work, capsys):
    run = work / "run"
    run.mkdir()
    pid = _dead_pid()
    (run / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "started": "then"}))
    lock = lock_run_dir(run)
    assert f"taking over the stale lock {run / LOCK_FILE} of pid {pid}" in capsys.readouterr().out
    assert json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()
    (run / LOCK_FILE).write_text(json.dumps({"host": "node-elsewhere", "pid": 1234, "started": "then"}))
    with pytest.raises(ConfigError) as info:
        lock_run_dir(run)
    message = str(info.value)
    assert "host 'node-elsewhere', pid 1234" in message and f"delete {run / LOCK_FILE}" in message
    assert (run / LOCK_FILE).is_file()  # left for the operator


@pytest.mark.slow
def test_lock_of_a_killed_process_is_taken_over(work, capsys):
    """A real holder process: refused while it runs; after a kill -9 its kernel lock is gone and the lock file (its
    record still inside) is taken over with a note."""
    run = work / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from fastpo.storage import lock_run_dir; lock_run_dir(sys.argv[1]); "
                               "print('held', flush=True); sys.stdin.read()", str(run)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError, match=f"pid {holder.pid}"):
            lock_run_dir(run)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    lock = lock_run_dir(run)
    assert f"of pid {holder.pid}" in capsys.readouterr().out
    lock.release()


@pytest.mark.slow
def test_torchrun_ranks_all_exit_2_on_a_locked_run_dir(work):
    """Only rank 0 locks; the refusal reaches rank 1 (no hang), both exit 2, rank 0 prints one line."""
    run = work / "run"
    lock = lock_run_dir(run)
    try:
        rc, out, err = run_killable([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node=2", "-m", "fastpo.train", *SMALL, "--trainer.run_dir",
                                     str(run)], work, ENV, 240)
    finally:
        lock.release()
    assert rc != 0 and err.replace("exitcode  :", "exitcode :").count("exitcode : 2") == 2, err[-3000:]  # both ranks
    lines = _error_lines(err)
    assert len(lines) == 1 and f"pid {os.getpid()}" in lines[0], err[-3000:]
    assert "/fastpo/" not in err, err[-3000:]  # the only traceback is torchrun's own summary, no worker's
    assert not (run / "config.json").exists()


# ---------------------------------------------------------------------- 6. huge collective timeouts
def test_process_group_timeout_clamps_huge_values():
    import datetime

    from fastpo.train import MAX_COLLECTIVE_TIMEOUT_S, process_group_timeout

    assert process_group_timeout(300.0) == 300.0
    for huge in (1e300, float("inf"), 1e10, MAX_COLLECTIVE_TIMEOUT_S * 2):
        assert process_group_timeout(huge) == MAX_COLLECTIVE_TIMEOUT_S
    for bad in (float("nan"), 0.0, -1.0, float("-inf")):
        assert process_group_timeout(bad) is None  # validate refuses it with the accepted range
    datetime.timedelta(seconds=MAX_COLLECTIVE_TIMEOUT_S)  # what init_process_group builds from it


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def torchrun_env(monkeypatch):
    """The environment torchrun gives a one-rank job: fastpo.distributed.init builds a real gloo process group."""
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(_free_port())}.items():
        monkeypatch.setenv(key, value)


def test_huge_collective_timeout_reaches_the_process_group(work, torchrun_env, capsys):
    from fastpo import distributed as du
    from fastpo.config_load import parse_args
    from fastpo.train import MAX_COLLECTIVE_TIMEOUT_S, _init, process_group_timeout

    # through train.main: a bad value beside a huge timeout is refused in one line, before the process group
    rc = _main([*TINY, "--trainer.collective_timeout_s", "1e300", "--rollout.temperature", "nan",
                "--trainer.run_dir", str(work / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "rollout.temperature" in err and "Traceback" not in err, err
    assert not du.is_distributed()
    rc = _main([*TINY, "--trainer.collective_timeout_s", "inf", "--trainer.run_dir", str(work / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and "trainer.collective_timeout_s must be a finite number, got inf" in err, err
    # main's process group set-up (train._init) takes the huge value clamped, says so once, and does not overflow
    info, timeout = _init(parse_args([*TINY, "--trainer.collective_timeout_s", "1e300"]))
    try:
        assert du.is_distributed() and info.is_main and timeout == MAX_COLLECTIVE_TIMEOUT_S
        assert capsys.readouterr().err.count("longest timeout the process group takes") == 1
    finally:
        du.shutdown()
    # the clamped value works in a real process group
    du.init(timeout_s=process_group_timeout(1e300))
    try:
        assert du.broadcast_object("ok") == "ok" and storage.all_gather_object(1) == [1]
        du.barrier()
    finally:
        du.shutdown()
    assert process_group_timeout(1e300) == MAX_COLLECTIVE_TIMEOUT_S
