"""bench/bench_integrations.py: its main path end to end at tiny sizes (both sides, rows written to a tmp folder),
the ratios it reports, the Liger side's loss step (run with fastpo's module of the same interface, since
liger_kernel is not installed here) and the one-line refusals. Not timed.

Needs trl (skipped without it, like tests/test_integrations_trl.py).
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import bench_integrations as bi  # noqa: E402
import common  # noqa: E402

SMOKE = dict(completions=2, prompt_len=8, completion_len=16, threads=1)


@pytest.fixture
def isolated_env(monkeypatch):
    """main() pins threads and may allow a dirty tree through environment variables: restore them afterwards."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", common.ALLOW_DIRTY_ENV):
        monkeypatch.setenv(name, "1")


@pytest.mark.slow
def test_main_writes_rows_with_their_ratio(tmp_path, isolated_env):
    """--smoke runs the stock and the fastpo side, each in its own process, and appends 4 rows to the given results
    folder: every column filled, memory and steps/s positive and finite, the reported ratios computed from them."""
    out = bi.main(["--smoke", "--threads", "1", "--results-dir", str(tmp_path), "--allow-dirty"])
    path = tmp_path / "integrations.csv"
    assert out["csv"] == path
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["provider"], r["metric"]) for r in rows] == [
        ("trl", "steps_per_s"), ("trl", "peak_extra_rss"), ("fastpo", "steps_per_s"), ("fastpo", "peak_extra_rss")]
    for r in rows:
        assert set(r) == set(common.COLUMNS) and all(r[c] != "" for c in common.COLUMNS), r
        assert r["name"] == "trl_grpo_loss_step" and r["x_name"] == "tokens" and int(r["x_value"]) > 0
        values = [float(r[q]) for q in ("p50", "p20", "p80")]
        assert all(math.isfinite(v) and v > 0 for v in values), r
        assert float(r["p20"]) <= float(r["p50"]) <= float(r["p80"])
        assert "H=64 V=4096" in r["config"] and "paged_in=" in r["config"] and "load avg" in r["config"]
    mem = {r["provider"]: float(r["p50"]) for r in rows if r["metric"] == "peak_extra_rss"}
    assert out["ratios"]["fastpo_peak_ratio"] == pytest.approx(mem["fastpo"] / mem["trl"], rel=1e-9)
    assert out["ratios"]["fastpo_speedup"] > 0


def test_summarize_ratios():
    """Peak ratio = the side's peak / the stock peak; speed-up = stock p50 step time / the side's p50 step time;
    steps/s quantiles are those of 1 / step time."""
    results = {"trl": dict(peak_extra_mib=1000.0, paged_in_mib=0.5, step_s=[2.0, 4.0, 3.0], scored_tokens=7),
               "fastpo": dict(peak_extra_mib=250.0, paged_in_mib=0.0, step_s=[1.0, 1.5, 2.0], scored_tokens=7)}
    rows, ratios = bi.summarize(results, "cfg")
    assert ratios == {"fastpo_peak_ratio": 0.25, "fastpo_speedup": 2.0}
    rate = [r for r in rows if r["provider"] == "trl" and r["metric"] == "steps_per_s"][0]
    assert rate["p50"] == pytest.approx(1 / 3) and rate["x_value"] == 7
    assert rate["config"] == "cfg; paged_in=0.5 MiB"


def test_liger_refused_without_liger_kernel(monkeypatch, capsys):
    """--liger stops with one line naming the missing package, before any model is built."""
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import fails whether or not it is installed
    monkeypatch.setattr(bi, "build_model", lambda *a, **k: pytest.fail("built a model before refusing"))
    with pytest.raises(SystemExit) as exc:
        bi.main(["--liger", "--no-csv"])
    msg = str(exc.value)
    assert "--liger needs liger_kernel" in msg and "\n" not in msg


def test_device_refusals(monkeypatch):
    import torch

    with pytest.raises(SystemExit, match=r"--device must be one of \('cpu', 'cuda'\), got 'tpu'"):
        bi.main(["--device", "tpu", "--no-csv"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--device cuda: torch sees no CUDA device"):
        bi.main(["--device", "cuda", "--no-csv"])


@pytest.mark.slow
def test_liger_side_loss_step_matches_fastpo(tmp_path):
    """The Liger side's loss step (hidden states of the completion positions + lm-head weight into a loss module of
    Liger's interface) run with fastpo's FastPOFusedLinearGRPOLoss gives FastPOGRPOTrainer's loss and gradients on
    the same batch: the side feeds the module the right positions, mask, advantages and old logprobs."""
    import torch

    from fastpo.kernels import FastPOFusedLinearGRPOLoss

    bi.build_model(tmp_path / "model", 64, 4096, 1)
    losses, grads = {}, {}
    for provider in ("fastpo", "liger"):
        spec = dict(SMOKE, provider=provider, model=str(tmp_path / "model"), out=str(tmp_path / provider))
        trainer = bi.make_trainer(spec, loss_cls=FastPOFusedLinearGRPOLoss)
        model = trainer.model
        batch = bi.make_batch(spec, model.config.vocab_size, "cpu")
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        losses[provider] = loss.detach()
        grads[provider] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    torch.testing.assert_close(losses["liger"], losses["fastpo"], rtol=1e-5, atol=1e-7)
    assert losses["fastpo"].abs() > 0 and grads["liger"].keys() == grads["fastpo"].keys()
    for name, g in grads["fastpo"].items():
        torch.testing.assert_close(grads["liger"][name], g, rtol=1e-4, atol=1e-6, msg=name)
