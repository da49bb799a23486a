"""fastpo.metrics: metrics.jsonl, console line, null ranks, optional backends, timers, memory, Echo Trap."""

import importlib.util
import io
import json
import math
import time
from types import SimpleNamespace

import pytest

from fastpo.metrics import (
    EchoTrapMonitor,
    EchoTrapThresholds,
    MetricsLogger,
    PhaseTimer,
    console_line,
    memory_metrics,
)

FULL = {
    "rollout/reward": 0.5123,
    "rollout/success": 0.40625,
    "rollout/action_is_valid": 0.97,
    "rollout/response_length": 123.4,
    "actor/entropy": 0.8123,
    "actor/clipfrac": 0.0312,
    "actor/kl": 0.00123,
    "actor/grad_norm": 1.234,
    "perf/tokens_per_s": 12345.0,
    "perf/env_steps_per_s": 456.0,
    "memory/rss_gb": 1.234,
    "timing/iteration": 3.45,
    "critic/loss": 9.0,  # not on the console line
}


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_records_and_non_finite_as_null(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, rank=0, stream=out)
    logger.log(0, {"rollout/reward": 0.5, "actor/kl": float("nan")})
    logger.log(1, {"rollout/reward": float("inf"), "actor/kl": 0.25})
    # flushed after each log, before close
    records = _read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1]
    assert records[0]["rollout/reward"] == 0.5 and records[0]["actor/kl"] is None
    assert records[1]["rollout/reward"] is None and records[1]["actor/kl"] == 0.25
    assert dict(logger.non_finite) == {"actor/kl": 1, "rollout/reward": 1}
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "non-finite: actor/kl" in lines[0]
    logger.close()
    # appending in a resumed run
    MetricsLogger(tmp_path, rank=0, console=False).log(2, {"x": 1})
    assert len(_read(tmp_path / "metrics.jsonl")) == 3


def test_tensor_values_are_accepted(tmp_path):
    torch = pytest.importorskip("torch")
    logger = MetricsLogger(tmp_path, rank=0, console=False)
    logger.log(3, {"actor/entropy": torch.tensor(0.5)})
    assert _read(tmp_path / "metrics.jsonl")[0]["actor/entropy"] == 0.5


def test_console_line_fixed_order_and_short_names():
    line = console_line(12, FULL)
    assert line == (
        "step     12 | reward 0.512 | succ 0.406 | valid 0.970 | resp 123 | ent 0.812 | clip 0.031 | "
        "kl 1.2e-03 | gnorm 1.23 | tok/s 12.3k | env/s 456 | mem 1.23G | time 3.5s"
    )
    assert console_line(5, {"actor/approx_kl": 0.5, "rollout/reward": 1.0}) == "step      5 | reward 1.000 | kl 5.0e-01"


def test_one_console_line_per_log(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, rank=0, stream=out, jsonl=False, total_steps=10)  # StringIO: not a TTY
    for step in range(3):
        logger.log(step, FULL)
    assert out.getvalue().count("\n") == 3
    assert not (tmp_path / "metrics.jsonl").exists()


def test_non_zero_rank_writes_nothing(tmp_path):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path / "run", rank=1, stream=out)
    logger.log(0, FULL)
    logger.warn("x")
    logger.close()
    assert out.getvalue() == "" and not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["tensorboard", "wandb"])
def test_missing_backend_raises_import_error_naming_it(tmp_path, flag):
    if importlib.util.find_spec(flag) is not None:
        pytest.skip(f"{flag} is installed")
    with pytest.raises(ImportError, match=f"`{flag}`"):
        MetricsLogger(tmp_path, rank=0, **{flag: True})


def test_phase_timer_accumulates_and_resets():
    timer = PhaseTimer()
    for _ in range(2):
        with timer("generate"):
            time.sleep(0.01)
    with timer("update"):
        pass
    m = timer.pop()
    assert set(m) == {"timing/generate", "timing/update"}
    assert 0.02 <= m["timing/generate"] < 1.0 and m["timing/update"] < m["timing/generate"]
    assert timer.pop() == {}


def test_memory_metrics_reports_rss_without_gpu():
    m = memory_metrics()
    assert 0.01 < m["memory/rss_gb"] < 64
    if not __import__("torch").cuda.is_available():
        assert not any(k.startswith(("gpu/", "memory/cuda")) for k in m)


class _FakeNVMLError(Exception):
    pass


class _FakeNVML:
    """pynvml with two GPUs: the one at NVML index 0 is another GPU; ours has UUID GPU-ours."""

    NVMLError = _FakeNVMLError

    def __init__(self, util_error: bool = False):
        self.util_error, self.asked = util_error, []

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.asked.append(uuid)
        if uuid != "GPU-ours":
            raise _FakeNVMLError("not found")
        return "ours"

    def nvmlDeviceGetHandleByIndex(self, index):
        return "other" if index == 0 else "ours"

    def nvmlDeviceGetUtilizationRates(self, handle):
        if self.util_error:
            raise _FakeNVMLError("NotSupported")
        return SimpleNamespace(gpu={"ours": 37, "other": 99}[handle])

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used={"ours": 2**30, "other": 5 * 2**30}[handle])


@pytest.mark.parametrize("uuid,visible,want", [
    ("ours", "3", (37.0, 1.0)),       # found by UUID, whatever CUDA_VISIBLE_DEVICES renumbered
    ("mig-x", None, None),             # a UUID NVML does not list: no GPU keys, no error
    (None, "3", None),                  # no UUID and renumbered devices: the index would name another GPU
    (None, None, (99.0, 5.0)),          # no UUID, nothing renumbered: CUDA index 0 is NVML index 0
])
def test_memory_metrics_reads_the_gpu_it_runs_on(monkeypatch, uuid, visible, want):
    import torch

    import fastpo.metrics as M

    nvml = _FakeNVML()
    monkeypatch.setitem(M._NVML, "module", nvml)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda dev: 2**31)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda dev: SimpleNamespace(uuid=uuid))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    m = memory_metrics("cuda:0")
    assert m["memory/cuda_max_allocated_gb"] == 1.0 and m["memory/cuda_max_reserved_gb"] == 2.0
    got = (m["gpu/util_percent"], m["gpu/memory_used_gb"]) if "gpu/util_percent" in m else None
    assert got == want
    nvml.util_error = True  # NotSupported (a MIG slice): the keys are absent, the iteration goes on
    m = memory_metrics("cuda:0")
    assert "gpu/util_percent" not in m and "gpu/memory_used_gb" not in m and "memory/rss_gb" in m


def _run(monitor, series):
    return [monitor.update(m) for m in series]


def test_echo_trap_quiet_on_stable_series():
    mon = EchoTrapMonitor()
    series = [
        {
            "rollout/in_group_std": 0.3 + 0.02 * (i % 3),
            "actor/entropy": 1.0 + 0.05 * math.sin(i),
            "actor/grad_norm": 1.0 + 0.2 * math.cos(i),
            "critic/grad_norm": 5.0 + (i % 2),
        }
        for i in range(40)
    ]
    assert all(w == [] for w in _run(mon, series))
    assert mon.metrics() == {"echo_trap/in_group_std": 0.0, "echo_trap/entropy": 0.0, "echo_trap/grad_norm": 0.0}


def test_echo_trap_warns_on_collapse_signals():
    mon = EchoTrapMonitor(EchoTrapThresholds(std_floor=0.05, entropy_rel_change=0.5, grad_spike_k=5.0, window=5))
    stable = {"rollout/in_group_std": 0.3, "actor/entropy": 1.0, "actor/grad_norm": 1.0}
    assert _run(mon, [stable] * 5) == [[]] * 5
    w = mon.update({"rollout/in_group_std": 0.01, "actor/entropy": 1.0, "actor/grad_norm": 1.0})
    assert len(w) == 1 and "in-group reward std 0.01 < floor 0.05" in w[0]
    w = mon.update({**stable, "actor/entropy": 0.3})
    assert len(w) == 1 and "entropy dropped" in w[0] and "-70%" in w[0]
    w = mon.update({**stable, "actor/entropy": 1.8})
    assert len(w) == 1 and "entropy jumped" in w[0]
    w = mon.update({**stable, "actor/grad_norm": 7.5})
    assert len(w) == 1 and "actor/grad_norm 7.5 is 7.5x" in w[0]
    w = mon.update({**stable, "actor/grad_norm": float("nan")})  # non-finite values are skipped
    assert w == []
    assert mon.counts == {"in_group_std": 1, "entropy": 2, "grad_norm": 1}
    assert mon.metrics()["echo_trap/entropy"] == 2.0


def test_echo_trap_entropy_jump_has_its_own_factor():
    """trainer.entropy_jump_factor: a jump is judged by its own multiple of the running median, a drop by the drop
    factor (the default without a jump factor stays symmetric: 1 + entropy_rel_change)."""
    stable = {"actor/entropy": 1.0}
    mon = EchoTrapMonitor(EchoTrapThresholds(entropy_rel_change=0.5, entropy_jump_factor=2.0, window=5))
    _run(mon, [stable] * 5)
    assert mon.update({"actor/entropy": 1.8}) == []  # +80% < 2x: no jump
    w = mon.update({"actor/entropy": 2.1})
    assert len(w) == 1 and "entropy jumped" in w[0] and "threshold 2x" in w[0]
    w = mon.update({"actor/entropy": 0.4})
    assert len(w) == 1 and "entropy dropped" in w[0] and "threshold -50%" in w[0]
    inf = EchoTrapMonitor(EchoTrapThresholds(entropy_rel_change=0.5, entropy_jump_factor=float("inf"), window=5))
    _run(inf, [stable] * 5)
    assert inf.update({"actor/entropy": 50.0}) == []


def test_echo_trap_needs_history_before_comparing():
    mon = EchoTrapMonitor(EchoTrapThresholds(min_history=3))
    assert _run(mon, [{"actor/grad_norm": g} for g in (1.0, 100.0, 1.0)]) == [[], [], []]
    with pytest.raises(ValueError, match="min_history"):
        EchoTrapMonitor(EchoTrapThresholds(window=2, min_history=3))


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_on_a_tty(tmp_path, monkeypatch):
    # the bar goes to its own stream (stderr by default) when that is a terminal, and counts iterations (step 1
    # is the first; step 0 is the validation before training)
    monkeypatch.delenv("FASTPO_PROGRESS", raising=False)
    out, bar = io.StringIO(), _Tty()
    logger = MetricsLogger(tmp_path, rank=0, stream=out, jsonl=False, total_steps=4, progress_stream=bar)
    logger.log(1, {"rollout/reward": 1.0})
    logger.close()
    assert "step      1 | reward 1.000" in out.getvalue() and "1/4" in bar.getvalue()
