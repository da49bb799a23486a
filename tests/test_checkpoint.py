"""fastpo.checkpoint: exact resume, torn writes, pruning, config-hash check, HF export, FSDP2 across 2 ranks."""

import json
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fastpo import checkpoint
from fastpo.testing import run_killable

REPO = Path(__file__).resolve().parents[1]


def _make():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda i: 1.0 / (1 + i))
    return {"model": model, "optim": optim, "sched": sched}


def _train(objs, steps: int) -> None:
    model, optim, sched = objs["model"], objs["optim"], objs["sched"]
    for _ in range(steps):
        # draws from all three global RNGs, so an unrestored RNG changes the result
        x = torch.randn(16, 4) * float(np.random.rand()) + random.random()
        loss = model(x).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        sched.step()


def _seed(s: int) -> None:
    torch.manual_seed(s)
    np.random.seed(s)
    random.seed(s)


def _save(run_dir, step, objs=None, **kw):
    return checkpoint.save(run_dir, step, objs or _make(), {"env_seed": step}, **kw)


def test_resume_is_bitwise_exact(tmp_path):
    _seed(1)
    ref = _make()
    _train(ref, 3)
    path = checkpoint.save(tmp_path, 3, ref, {"env_seed": 11, "weight_version": 3}, config_hash="abc")
    assert path == tmp_path / "checkpoints" / "step-000003"
    assert sorted(p.name for p in path.iterdir() if not p.name.endswith(".distcp")) == [
        ".metadata",
        "COMPLETE",
        "rng-rank-00000.json",
        "trainer_state.json",
    ]
    _train(ref, 3)  # uninterrupted

    _seed(99)  # a different RNG state and a fresh model/optimiser/scheduler
    resumed = _make()
    state = checkpoint.resume(tmp_path, resumed, mode="auto", config_hash="abc")
    assert state == {"env_seed": 11, "weight_version": 3}
    assert resumed["sched"].last_epoch == 3
    _train(resumed, 3)
    for a, b in zip(ref["model"].parameters(), resumed["model"].parameters(), strict=True):
        assert torch.equal(a, b)
    sa, sb = ref["optim"].state_dict()["state"], resumed["optim"].state_dict()["state"]
    for k in sa:
        assert torch.equal(sa[k]["exp_avg_sq"], sb[k]["exp_avg_sq"])
        assert torch.equal(sa[k]["step"], sb[k]["step"])


def test_without_load_parameters_differ(tmp_path):
    """Guards the test above: a fresh model trained 3 steps is not equal to the reference."""
    _seed(1)
    ref = _make()
    _train(ref, 6)
    other = _make()
    _train(other, 3)
    assert not torch.equal(next(ref["model"].parameters()), next(other["model"].parameters()))


def test_latest_ignores_tmp_and_unmarked_dirs(tmp_path):
    assert checkpoint.latest(tmp_path) is None
    _save(tmp_path, 5)
    root = tmp_path / "checkpoints"
    torn = root / "step-000009.tmp-12345"
    torn.mkdir()
    (torn / "COMPLETE").write_text("{}")  # even with a marker, a .tmp dir is never chosen
    (root / "step-000008").mkdir()  # renamed but no marker: incomplete
    (root / "step-000007").write_text("not a dir")
    assert checkpoint.latest(tmp_path) == root / "step-000005"
    assert checkpoint.resume(tmp_path, _make(), mode="auto") == {"env_seed": 5}
    with pytest.raises(FileNotFoundError, match="COMPLETE"):
        checkpoint.resume(tmp_path, _make(), mode=root / "step-000008")
    # the next save removes stale .tmp dirs of earlier steps
    _save(tmp_path, 10)
    assert not torn.exists()
    assert checkpoint.latest(tmp_path) == root / "step-000010"


def test_crash_during_save_leaves_previous_checkpoint_latest(tmp_path, monkeypatch):
    _save(tmp_path, 1)

    def crash(state_dict, checkpoint_id, **kw):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half a shard")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.dcp, "save", crash)
    with pytest.raises(OSError, match="disk full"):
        _save(tmp_path, 2)
    assert [p.name for p in (tmp_path / "checkpoints").glob("step-000002*")] == [f"step-000002.tmp-{os.getpid()}"]
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "step-000001"
    monkeypatch.undo()
    _save(tmp_path, 2)  # retrying the same step in the same process works
    assert checkpoint.latest(tmp_path) == tmp_path / "checkpoints" / "step-000002"


def test_trainer_state_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="JSON"):
        checkpoint.save(tmp_path, 1, _make(), {"t": torch.zeros(1)})
    assert not (tmp_path / "checkpoints").exists()


def test_keep_last_prunes_oldest(tmp_path):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-000003", "step-000004"]
    _save(tmp_path, 4, keep_last=2)  # re-saving a step replaces it
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003", "step-000004"]
    with pytest.raises(ValueError, match="keep_last"):
        _save(tmp_path, 5, keep_last=0)


def test_config_hash_refused_unless_forced(tmp_path, capsys):
    _save(tmp_path, 1, config_hash="aaa111")
    with pytest.raises(ValueError, match="aaa111.*bbb222"):
        checkpoint.resume(tmp_path, _make(), config_hash="bbb222")
    assert checkpoint.resume(tmp_path, _make(), config_hash="bbb222", force=True) == {"env_seed": 1}
    assert "forced" in capsys.readouterr().out
    assert checkpoint.resume(tmp_path, _make(), mode="never", config_hash="bbb222") is None
    meta = json.loads((tmp_path / "checkpoints" / "step-000001" / "trainer_state.json").read_text())
    assert meta["config_hash"] == "aaa111" and meta["step"] == 1 and meta["world_size"] == 1


def test_optimizer_without_its_model_is_an_error(tmp_path):
    objs = _make()
    with pytest.raises(ValueError, match="optim"):
        checkpoint.save(tmp_path, 1, {"optim": objs["optim"]}, {})


def test_export_hf_loads_with_from_pretrained(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tiny")
    model = build_tiny_model(tmp_path / "tiny", tok, hidden=32, layers=1, heads=2, kv_heads=1)
    with torch.no_grad():
        model.model.norm.weight.add_(0.5)  # differ from the saved init
    out = checkpoint.export_hf(model, tok, tmp_path / "hf")
    assert (out / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    tok2 = AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok.encode("<think> go </think>")])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok2.apply_chat_template(msgs, tokenize=False) == tok.apply_chat_template(msgs, tokenize=False)


def _torchrun(*args: str, timeout: float = 120) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    rc, out, err = run_killable(cmd, REPO, env, timeout)
    assert rc == 0, (out + err)[-3000:]


def test_fsdp2_two_ranks_save_then_load_in_new_run(tmp_path):
    """Save from a 2-rank FSDP2 run, resume in a new 2-rank run: parameters after 2 more steps match the
    uninterrupted run bitwise. The second run also exports an FSDP2-sharded tiny Qwen2 to HF format."""
    from transformers import AutoModelForCausalLM

    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tiny")
    original = build_tiny_model(tmp_path / "tiny", tok, hidden=32, layers=2, heads=2, kv_heads=1)
    worker = str(REPO / "tests" / "dist_worker_checkpoint.py")
    _torchrun(worker, "save", str(tmp_path / "run"), str(tmp_path / "ref.pt"))
    _torchrun(
        worker,
        "load",
        str(tmp_path / "run"),
        str(tmp_path / "resumed.pt"),
        str(tmp_path / "tiny"),
        str(tmp_path / "hf"),
    )
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for (name, a), (_, b) in zip(original.state_dict().items(), exported.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ref, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "resumed.pt")
    assert ref["params"].keys() == resumed["params"].keys()
    for k in ref["params"]:
        assert torch.equal(ref["params"][k], resumed["params"][k]), k
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    assert (ckpt / "rng-rank-00000.json").is_file() and (ckpt / "rng-rank-00001.json").is_file()
