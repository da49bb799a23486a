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


def _steps(run_dir) -> list[str]:
    return sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())


def test_a_damaged_checkpoint_does_not_count_toward_keep(tmp_path):
    for step in (1, 2, 3):
        _save(tmp_path, step, keep_last=None)
    newest = tmp_path / "checkpoints" / "step-000003"
    (newest / "__0_0.distcp").write_bytes(b"torn")
    checkpoint._INTACT.clear()  # as in a new process: nothing is known to be intact
    _save(tmp_path, 4, keep_last=2)  # intact: 4, 2 (3 is damaged and newer than 2: kept, not counted)
    assert _steps(tmp_path) == ["step-000002", "step-000003", "step-000004"]
    _save(tmp_path, 5, keep_last=2)  # intact: 5, 4; everything older goes, the damaged 3 too
    assert _steps(tmp_path) == ["step-000004", "step-000005"]


def test_fewer_intact_checkpoints_than_keep_deletes_nothing(tmp_path):
    for step in (1, 2):
        _save(tmp_path, step, keep_last=None)
    for step in (1, 2):
        (tmp_path / "checkpoints" / f"step-{step:06d}" / "trainer_state.json").unlink()
    _save(tmp_path, 3, keep_last=2)  # one intact checkpoint (3) of the two wanted
    assert _steps(tmp_path) == ["step-000001", "step-000002", "step-000003"]
    _save(tmp_path, 3, keep_last=1)
    assert _steps(tmp_path) == ["step-000003"]


def test_the_newest_intact_checkpoint_survives_any_keep(tmp_path):
    _save(tmp_path, 1, keep_last=None)
    _save(tmp_path, 2, keep_last=None)
    (tmp_path / "checkpoints" / "step-000002" / "COMPLETE").write_text("{not json")
    plan = checkpoint.retention_plan(tmp_path / "checkpoints", 1, current_step=2)
    assert plan == []  # 2 is damaged, 1 is the newest intact one: nothing may go
    assert checkpoint.retention_plan(tmp_path / "checkpoints", None, current_step=2) == []


def test_steps_after_the_saved_one_are_left_alone(tmp_path):
    """A run resumed from an older checkpoint saves below the newest step: the later ones belong to the run it went
    back from, and the step just saved is never deleted."""
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=None)
    _save(tmp_path, 2, keep_last=1)
    assert _steps(tmp_path) == ["step-000002", "step-000003", "step-000004"]


def test_retention_does_not_hash_what_this_process_wrote(tmp_path, monkeypatch):
    seen = []
    real = checkpoint._hash_file
    monkeypatch.setattr(checkpoint, "_hash_file", lambda path: seen.append(path.parent.name) or real(path))
    _save(tmp_path, 1, keep_last=2)
    _save(tmp_path, 2, keep_last=2)
    assert set(seen) == {f"step-00000{s}.tmp-{os.getpid()}" for s in (1, 2)}  # the writes only
    seen.clear()
    checkpoint._INTACT.clear()  # a new process (e.g. after a resume) hashes an older checkpoint once
    _save(tmp_path, 3, keep_last=2)
    _save(tmp_path, 4, keep_last=2)
    assert {name for name in seen if ".tmp-" not in name} == {"step-000002"}
    assert _steps(tmp_path) == ["step-000003", "step-000004"]


_KILLED_PRUNE = """
import os, sys
import torch
from fastpo import checkpoint
run, case = sys.argv[1], sys.argv[2]
objs = {"m": torch.nn.Linear(2, 2)}
for step in (1, 2, 3):
    checkpoint.save(run, step, objs, {"step": step}, keep_last=None)
os.environ[checkpoint.KILL_DURING_PRUNE_ENV] = "1"
if case == "prune":
    checkpoint.save(run, 4, objs, {"step": 4}, keep_last=1)  # deletes 1, 2, 3: killed inside the first
else:
    checkpoint.save(run, 3, objs, {"step": 30}, keep_last=None)  # replaces step 3: killed deleting the old one
print("not killed")
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["prune", "replace"])
def test_a_prune_killed_midway_leaves_the_newest_intact_checkpoint(tmp_path, case):
    """kill -9 while old checkpoints are deleted: resume still loads the newest intact checkpoint, and the next
    prune (or start-up) finishes the deletion."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    rc, out, err = run_killable([sys.executable, "-c", _KILLED_PRUNE, str(tmp_path), case], REPO, env, 120)
    assert rc == -9 and "not killed" not in out, err[-3000:]
    root = tmp_path / "checkpoints"
    if case == "prune":
        assert _steps(tmp_path) == ["step-000001.discard", "step-000002", "step-000003", "step-000004"]
        newest, state = "step-000004", {"step": 4}
    else:
        assert _steps(tmp_path) == ["step-000001", "step-000002", "step-000003", "step-000003.discard"]
        newest, state = "step-000003", {"step": 30}
    discard = next(root.glob("*.discard"))
    assert len(list(discard.iterdir())) >= 1  # cut short after its first file
    assert checkpoint.latest(tmp_path) == root / newest
    assert checkpoint.resume(tmp_path, {"m": torch.nn.Linear(2, 2)}, mode="auto") == state
    if case == "prune":
        checkpoint.save(tmp_path, 5, {"m": torch.nn.Linear(2, 2)}, {"step": 5}, keep_last=1)
        assert _steps(tmp_path) == ["step-000005"]
    else:
        assert checkpoint.remove_stale_temp(tmp_path) == [discard]
        assert _steps(tmp_path) == ["step-000001", "step-000002", "step-000003"]


@pytest.mark.slow
def test_node_local_disks_prune_the_same_steps(tmp_path):
    """Two ranks, two disks that disagree: step 4 is torn on disk 1 only and step 2 is missing there. The plan is
    agreed: step 4 counts on neither, so both disks keep 3, 4, 5 (disk 0 alone would have kept 4, 5)."""
    _torchrun(str(REPO / "tests" / "dist_worker_retention.py"), str(tmp_path), str(tmp_path / "out.json"))
    rows = json.loads((tmp_path / "out.json").read_text())
    assert [r["before"] for r in rows] == [[f"step-{s:06d}" for s in (1, 2, 3, 4)]] * 2
    assert [r["after"] for r in rows] == [["step-000003", "step-000004", "step-000005"]] * 2
    assert [r["resumed"] for r in rows] == [{"step": 5}] * 2


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


@pytest.mark.slow
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
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:  # tied to the embeddings: stored once
        assert "lm_head.weight" not in f.keys() and "model.embed_tokens.weight" in f.keys()
    assert (tmp_path / "hf" / checkpoint.EXPORT_MARKER).is_file()
    for (name, a), (_, b) in zip(original.state_dict().items(), exported.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    ref, resumed = torch.load(tmp_path / "ref.pt"), torch.load(tmp_path / "resumed.pt")
    assert ref["params"].keys() == resumed["params"].keys()
    for k in ref["params"]:
        assert torch.equal(ref["params"][k], resumed["params"][k]), k
    ckpt = tmp_path / "run" / "checkpoints" / "step-000002"
    assert (ckpt / "rng-rank-00000.json").is_file() and (ckpt / "rng-rank-00001.json").is_file()


# ------------------------------------------------------------------------- integrity, fallback, disk full
def _two_checkpoints(run_dir):
    """Checkpoints at steps 1 and 2 of one training run (different weights); returns the step-1 weights."""
    _seed(1)
    objs = _make()
    _train(objs, 1)
    checkpoint.save(run_dir, 1, objs, {"env_seed": 1})
    weights = [p.detach().clone() for p in objs["model"].parameters()]
    _train(objs, 1)
    checkpoint.save(run_dir, 2, objs, {"env_seed": 2})
    return weights


def test_complete_marker_holds_the_manifest(tmp_path):
    path = _save(tmp_path, 3)
    files = json.loads((path / "COMPLETE").read_text())["files"]
    on_disk = sorted(p.name for p in path.iterdir() if p.name != "COMPLETE")
    assert sorted(files) == on_disk and ".metadata" in files and "trainer_state.json" in files
    import hashlib

    for name, (sha, size) in files.items():
        data = (path / name).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (sha, size)
    assert checkpoint.verify(path) is None


def _flip_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


_DAMAGE = {
    "truncated_shard": (lambda d: (d / "__0_0.distcp").write_bytes((d / "__0_0.distcp").read_bytes()[:100]),
                        "__0_0.distcp has 100 bytes"),
    "flipped_bit": (lambda d: _flip_bit(d / "__0_0.distcp"), "__0_0.distcp fails its sha256 check"),
    "bad_metadata": (lambda d: (d / ".metadata").write_bytes(b"\x80\x04garbage"), ".metadata has 9 bytes"),
    "bad_json": (lambda d: (d / "trainer_state.json").write_text("{\"step\": 2,"), "trainer_state.json has"),
    "bad_marker": (lambda d: (d / "COMPLETE").write_text("{not json"), "unreadable COMPLETE marker"),
    "missing_rng": (lambda d: (d / "rng-rank-00000.json").unlink(), "rng-rank-00000.json is missing"),
}


@pytest.mark.parametrize("damage", sorted(_DAMAGE))
def test_auto_resume_falls_back_to_the_newest_intact_checkpoint(tmp_path, capsys, damage):
    step1 = _two_checkpoints(tmp_path)
    newest = tmp_path / "checkpoints" / "step-000002"
    spoil, reason = _DAMAGE[damage]
    spoil(newest)
    assert reason in checkpoint.verify(newest)
    resumed = _make()
    assert checkpoint.resume(tmp_path, resumed, mode="auto") == {"env_seed": 1}
    err = capsys.readouterr().err
    assert "skipping checkpoint step-000002" in err and reason in err
    assert all(torch.equal(a, b) for a, b in zip(step1, resumed["model"].parameters(), strict=True))
    with pytest.raises(ValueError, match="step-000002 is damaged"):  # an explicit path is refused, not skipped
        checkpoint.resume(tmp_path, _make(), mode=str(newest))


def test_checkpoint_without_manifest_and_bad_metadata_is_skipped(tmp_path, capsys):
    """A checkpoint written before manifests existed: its unreadable .metadata fails the load, which falls back."""
    _two_checkpoints(tmp_path)
    newest = tmp_path / "checkpoints" / "step-000002"
    (newest / "COMPLETE").write_text(json.dumps({"step": 2}))
    (newest / ".metadata").write_bytes(b"\x80\x04garbage")
    assert checkpoint.verify(newest) is None  # nothing to check it against
    assert checkpoint.resume(tmp_path, _make(), mode="auto") == {"env_seed": 1}
    assert "skipping checkpoint step-000002" in capsys.readouterr().err


def test_every_checkpoint_damaged_starts_fresh(tmp_path, capsys):
    _two_checkpoints(tmp_path)
    for d in (tmp_path / "checkpoints").iterdir():
        _flip_bit(d / "__0_0.distcp")
    assert checkpoint.resume(tmp_path, _make(), mode="auto") is None
    assert capsys.readouterr().err.count("skipping checkpoint") == 2


def test_disk_full_during_save_says_so(tmp_path, monkeypatch):
    from fastpo.storage import DiskFullError

    _save(tmp_path, 1)
    monkeypatch.setenv("FASTPO_INJECT_DISK_FULL", "checkpoint")
    with pytest.raises(DiskFullError, match=r"disk full while writing the checkpoint of step 2 to .*step-000002\.tmp-"
                                            r"\d+ \(\d+\.\d MiB free\)"):
        _save(tmp_path, 2)
    assert checkpoint.latest(tmp_path).name == "step-000001" and checkpoint.verify(checkpoint.latest(tmp_path)) is None
    monkeypatch.delenv("FASTPO_INJECT_DISK_FULL")
    _save(tmp_path, 2)  # space freed: the next save works and removes the torn folder
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


def test_torch_short_write_is_reported_as_disk_full(tmp_path, monkeypatch):
    """torch's zip writer reports ENOSPC as "unexpected pos N vs M"."""
    from fastpo.storage import DiskFullError

    def short_write(state_dict, checkpoint_id, **kw):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")

    monkeypatch.setattr(checkpoint.dcp, "save", short_write)
    with pytest.raises(DiskFullError, match="disk full while writing the checkpoint of step 1") as info:
        _save(tmp_path, 1)
    assert "unexpected pos 704 vs 598" in str(info.value.__cause__)


def test_export_is_atomic_and_a_cut_short_export_leaves_nothing(tmp_path, monkeypatch):
    from fastpo.report import format_report
    from fastpo.storage import DiskFullError
    from fastpo.testing import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer(tmp_path / "tiny")
    model = build_tiny_model(tmp_path / "tiny", tok, hidden=32, layers=1, heads=2, kv_heads=1)
    monkeypatch.setenv("FASTPO_INJECT_DISK_FULL", "export")
    with pytest.raises(DiskFullError, match="disk full while writing the Hugging Face export"):
        checkpoint.export_hf(model, tok, tmp_path / "hf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # no hf/, no hf.tmp-*
    assert "Hugging Face export: none" in format_report(tmp_path, None, [])
    monkeypatch.delenv("FASTPO_INJECT_DISK_FULL")
    out = checkpoint.export_hf(model, tok, tmp_path / "hf")
    assert (out / checkpoint.EXPORT_MARKER).is_file()
    assert f"Hugging Face export: {out}" in format_report(tmp_path, None, [])
    (out / checkpoint.EXPORT_MARKER).unlink()  # an export cut short by a crash, as older versions left them
    assert "Hugging Face export: none" in format_report(tmp_path, None, [])


def test_resume_under_another_thread_count_warns(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        _save(tmp_path, 1)
        torch.set_num_threads(2)
        checkpoint.resume(tmp_path, _make())
        err = capsys.readouterr().err
        assert "saved with 1 torch threads, this run has 2" in err and "OMP_NUM_THREADS=1" in err
        torch.set_num_threads(1)
        checkpoint.resume(tmp_path, _make())
        assert "torch threads" not in capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)


def test_short_write_inside_dcp_is_reported_as_disk_full(tmp_path, monkeypatch):
    """The same failure as DCP reports it: wrapped in its CheckpointException (a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from fastpo.storage import DiskFullError

    def short_write(state_dict, checkpoint_id, **kw):
        raise CheckpointException("save", {0: (RuntimeError("unexpected pos 704 vs 598"), None)})

    monkeypatch.setattr(checkpoint.dcp, "save", short_write)
    with pytest.raises(DiskFullError, match="disk full while writing the checkpoint of step 1"):
        _save(tmp_path, 1)


def test_verify_parts_share_the_hashing(tmp_path):
    path = _save(tmp_path, 1)
    names = sorted(json.loads((path / "COMPLETE").read_text())["files"])
    _flip_bit(path / names[1])
    assert checkpoint.verify(path, (0, 2)) is None  # hashes files 0, 2, ...: not the damaged one
    assert "fails its sha256 check" in checkpoint.verify(path, (1, 2))
    assert "fails its sha256 check" in checkpoint.verify(path)


def test_real_full_disk_is_reported_as_disk_full(tmp_path):
    """A 1 MiB tmpfs (needs root and mount rights; skipped otherwise): torch's writer fails with "unexpected pos",
    safetensors with "os error 28"; both errors say disk full and name the folder, and nothing is published."""
    import subprocess

    from fastpo.storage import DiskFullError

    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                                           capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = torch.nn.Linear(400, 400)  # 640 KB of weights + 1.3 MB of AdamW state: more than the disk
        optim = torch.optim.AdamW(model.parameters())
        model(torch.randn(2, 400)).sum().backward()
        optim.step()
        with pytest.raises(DiskFullError, match=r"disk full while writing the checkpoint of step 1 to .*tmp-\d+ "
                                                r"\(0\.\d MiB free\)") as info:
            checkpoint.save(disk / "run", 1, {"model": model, "optim": optim}, {})
        assert "unexpected pos" in repr(info.value.__cause__)
        assert checkpoint.latest(disk / "run") is None
        from fastpo.testing import build_tiny_model, build_tiny_tokenizer

        tok = build_tiny_tokenizer(tmp_path / "tiny")
        tiny = build_tiny_model(tmp_path / "tiny", tok, hidden=64, layers=2, heads=2, kv_heads=1)
        with pytest.raises(DiskFullError, match="disk full while writing the Hugging Face export"):
            checkpoint.export_hf(tiny, tok, disk / "run" / "hf")  # safetensors says "os error 28"
        assert sorted(p.name for p in (disk / "run").iterdir()) == ["checkpoints"]  # no hf/, no hf.tmp-*
    finally:
        subprocess.run(["umount", str(disk)], check=False)
