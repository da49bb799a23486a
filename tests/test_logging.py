"""The logs a RAGEN user reads: verl's data metrics, RAGEN metric names, the generations table, W&B (config, run
name, resume by id; a fake ``wandb`` module, the package is not a dependency), and validation at the last
iteration through the real entry point."""

import importlib.machinery
import io
import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from fastpo.config import Config, ConfigError
from fastpo.metrics import (
    GENERATION_FIELDS,
    MetricsLogger,
    data_metrics,
    pick_generations,
    ragen_metric_name,
    rename_metrics,
)
from fastpo.preflight import validate


# ----------------------------------------------------------------------------------------------- data metrics
def test_data_metrics_are_verls_formulas_over_trained_tokens():
    masks = [np.array([0, 0, 1, 1, 0, 1], bool), np.array([0, 1, 1, 0], bool)]
    adv = [np.array([9, 9, 0.5, -1.0, 9, 2.0], np.float32), np.array([9, 1.5, -0.5, 9], np.float32)]
    ret = [np.array([9, 9, 1.0, 0.0, 9, 3.0], np.float32), np.array([9, 2.0, 1.0, 9], np.float32)]
    val = [np.array([9, 9, 0.5, 0.0, 9, 2.0], np.float32), np.array([9, 1.0, 1.0, 9], np.float32)]
    m = data_metrics([1.0, -0.5], masks, adv, ret, val, lengths=[6, 4], max_len=6)
    a, r, v = [0.5, -1.0, 2.0, 1.5, -0.5], [1.0, 0.0, 3.0, 2.0, 1.0], [0.5, 0.0, 2.0, 1.0, 1.0]
    expected = {
        "critic/score/mean": 0.25, "critic/score/max": 1.0, "critic/score/min": -0.5,
        "critic/rewards/mean": 0.25, "critic/rewards/max": 1.0, "critic/rewards/min": -0.5,
        "critic/advantages/mean": sum(a) / 5, "critic/advantages/max": 2.0, "critic/advantages/min": -1.0,
        "critic/returns/mean": sum(r) / 5, "critic/returns/max": 3.0, "critic/returns/min": 0.0,
        "critic/values/mean": sum(v) / 5, "critic/values/max": 2.0, "critic/values/min": 0.0,
        # 1 - var(R - V) / (var(R) + 1e-5), unbiased: R - V = [.5, 0, 1, 1, 0] (var 0.25), var(R) = 1.3
        "critic/vf_explained_var": 1 - 0.25 / (1.3 + 1e-5),
        "response_length/mean": 3.5, "response_length/max": 4, "response_length/min": 3,
        "response_length/clip_ratio": 0.5, "prompt_length/mean": 1.5, "prompt_length/max": 2, "prompt_length/min": 1,
    }
    assert m == pytest.approx(expected, rel=1e-6)
    # outcome estimators (no critic): returns are the advantages, no value keys
    m = data_metrics([1.0, -0.5], masks, adv)
    assert m["critic/returns/mean"] == m["critic/advantages/mean"] == pytest.approx(sum(a) / 5)
    assert not any(k.startswith(("critic/values", "critic/vf_", "response_length")) for k in m)


# ----------------------------------------------------------------------------------------------- names
def test_ragen_metric_names():
    assert ragen_metric_name("env/FrozenLake/success") == "train/FrozenLake/success"
    assert ragen_metric_name("env/Sokoban/pass@8") == "train/SimpleSokoban/pass@8"
    assert ragen_metric_name("val-env/Sokoban/action_is_valid") == "val-env/SimpleSokoban/action_is_valid"
    assert ragen_metric_name("val-env/BanditTest/success") == "val-env/BanditTest/success"
    assert ragen_metric_name("actor/entropy") == "actor/entropy_loss"
    assert ragen_metric_name("timing/generate") == "timing_s/gen"
    for same in ("rollout/in_group_std", "rollout/chosen_in_group_max", "actor/pg_clipfrac", "critic/vf_loss",
                 "critic/score/mean", "response_length/clip_ratio"):
        assert ragen_metric_name(same) == same
    assert rename_metrics({"env/X/success": 1.0}, "fastpo") == {"env/X/success": 1.0}
    with pytest.raises(ValueError, match="trainer.metric_names must be one of"):
        rename_metrics({}, "verl")


# ----------------------------------------------------------------------------------------------- fake wandb
class FakeRun:
    def __init__(self, kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, data, step=None):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    mod = types.ModuleType("wandb")
    mod.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    mod.runs = []

    def init(**kwargs):
        mod.runs.append(FakeRun(kwargs))
        return mod.runs[-1]

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    mod.init, mod.Table = init, Table
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def test_wandb_config_name_resume_and_ragen_names(tmp_path, fake_wandb):
    run_dir = tmp_path / "my-run"
    cfg = {"algorithm": {"adv_estimator": "gae"}}
    logger = MetricsLogger(run_dir, 0, wandb=True, project="p", config=cfg, metric_names="ragen",
                           stream=io.StringIO())
    logger.log(1, {"env/Sokoban/success": 0.5, "actor/entropy": 1.25})
    logger.close()
    first = fake_wandb.runs[0]
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    assert first.kwargs["name"] == "my-run" and first.kwargs["config"] == cfg and first.kwargs["project"] == "p"
    assert first.kwargs["id"] == run_id and first.kwargs["resume"] == "allow" and first.finished
    assert first.logged == [(1, {"train/SimpleSokoban/success": 0.5, "actor/entropy_loss": 1.25})]
    row = json.loads((run_dir / "metrics.jsonl").read_text())
    assert row["train/SimpleSokoban/success"] == 0.5 and "env/Sokoban/success" not in row
    # a resumed run continues the stored id; a fresh start draws a new one
    MetricsLogger(run_dir, 0, wandb=True, run_name="named", wandb_resume=True, stream=io.StringIO()).close()
    assert fake_wandb.runs[1].kwargs["id"] == run_id and fake_wandb.runs[1].kwargs["name"] == "named"
    MetricsLogger(run_dir, 0, wandb=True, wandb_resume=False, stream=io.StringIO()).close()
    assert fake_wandb.runs[2].kwargs["id"] != run_id
    assert (run_dir / "wandb_run_id").read_text().strip() == fake_wandb.runs[2].kwargs["id"]
    # other ranks never touch W&B
    MetricsLogger(tmp_path / "other", 1, wandb=True).close()
    assert len(fake_wandb.runs) == 3


def test_generations_go_to_jsonl_and_wandb_table(tmp_path, fake_wandb):
    rows = [{"env": "FrozenLake", "group": g, "seed": 123 + g, "prompt": f"p{g}", "response": "r|x\ny",
             "reward": float(g), "success": g == 1} for g in range(3)]
    logger = MetricsLogger(tmp_path, 0, wandb=True, stream=io.StringIO())
    logger.log_generations(4, rows)
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [4, 4, 4] and lines[1] == {**rows[1], "step": 4}
    assert tuple(lines[0]) == GENERATION_FIELDS
    step, data = fake_wandb.runs[0].logged[0]
    table = data["val/generations"]
    assert step == 4 and table.columns == list(GENERATION_FIELDS) and len(table.data) == 3
    assert table.data[2][GENERATION_FIELDS.index("reward")] == 2.0


def test_generations_tensorboard_text_table(tmp_path, monkeypatch):
    """A fake torch.utils.tensorboard (tensorboard is not a dependency): scalars by RAGEN name, the text table."""
    calls = []

    class Writer:
        def __init__(self, log_dir):
            calls.append(("init", log_dir))

        def add_scalar(self, key, value, step):
            calls.append(("scalar", key, value, step))

        def add_text(self, tag, text, step):
            calls.append(("text", tag, text, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("close",))

    tb = types.ModuleType("tensorboard")
    tb.__spec__ = importlib.machinery.ModuleSpec("tensorboard", None)
    writer_mod = types.ModuleType("torch.utils.tensorboard")
    writer_mod.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "tensorboard", tb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", writer_mod)
    logger = MetricsLogger(tmp_path, 0, tensorboard=True, metric_names="ragen", stream=io.StringIO())
    logger.log(3, {"env/Sokoban/success": 1.0})
    logger.log_generations(3, [{"env": "Sokoban", "prompt": "a|b", "response": "x\ny", "reward": 1.0}])
    logger.close()
    assert ("scalar", "train/SimpleSokoban/success", 1.0, 3) in calls
    (tag, text, step), = [c[1:] for c in calls if c[0] == "text"]
    assert tag == "val/generations" and step == 3
    lines = text.splitlines()
    assert lines[0] == "| " + " | ".join(GENERATION_FIELDS) + " |" and len(lines) == 3
    assert "a\\|b" in lines[2] and "x<br>y" in lines[2] and "| 3 |" in lines[2]


def test_pick_generations_is_ragens_seeded_sample():
    records = [{"prompt": f"p{i:02d}", "response": "r", "reward": i} for i in range(30)]
    picked = pick_generations(records[::-1], 5)
    assert picked == pick_generations(records, 5)  # independent of the order ranks deliver them in
    order = np.arange(30)
    np.random.RandomState(42).shuffle(order)
    assert [r["prompt"] for r in picked] == [f"p{i:02d}" for i in order[:5]]
    assert pick_generations(records, 0) == [] and len(pick_generations(records, 100)) == 30


def test_missing_sink_package_is_a_config_error():
    cfg = Config()
    for flag, package in (("log_wandb", "wandb"), ("log_tensorboard", "tensorboard")):
        if importlib.util.find_spec(package) is not None:
            continue
        setattr(cfg.trainer, flag, True)
        with pytest.raises(ConfigError, match=rf"trainer.{flag}=true needs the {package} package.*fastpo\[{package}\]"):
            validate(cfg)
        setattr(cfg.trainer, flag, False)
    cfg.trainer.log_generations = -1
    with pytest.raises(ConfigError, match="trainer.log_generations must be >= 0"):
        validate(cfg)


# ----------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_train_logs_generations_data_metrics_and_validates_at_the_last_iteration(tmp_path, capsys):
    from test_trainer import SMALL, _main_ok, _metrics

    run = tmp_path / "run"
    _main_ok([*SMALL, "--trainer.iterations", "2", "--trainer.val_every", "5", "--trainer.log_generations", "3",
         "--algorithm.adv_estimator", "gae", "--trainer.metric_names", "ragen"], run, capsys)
    rows = _metrics(run)
    assert [r["step"] for r in rows] == [0, 1, 2]
    # val_every 5 > iterations 2: validation before training and at the last iteration only (RAGEN's rule)
    assert "val-env/FrozenLake/success" in rows[2] and "val-env/FrozenLake/success" not in rows[1]
    assert "train/FrozenLake/success" in rows[1] and "env/FrozenLake/success" not in rows[1]
    for key in ("critic/score/mean", "critic/advantages/max", "critic/returns/min", "critic/values/mean",
                "critic/vf_explained_var", "response_length/clip_ratio", "prompt_length/mean"):
        assert rows[1][key] is not None and np.isfinite(rows[1][key]), key
    gens = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert [g["step"] for g in gens] == [0, 0, 0, 2, 2, 2]
    assert all(g["env"] == "FrozenLake" and g["prompt"] and g["response"] for g in gens)
    assert [g["seed"] for g in gens[:3]] == [g["seed"] for g in gens[3:]]  # the same fixed-seed prompts
    assert all(123 <= g["seed"] < 127 for g in gens)  # val_seed 123 + group, 4 validation groups


@pytest.mark.slow
def test_data_metrics_and_generations_equal_on_one_and_two_ranks(tmp_path, capsys):
    from test_trainer import GAE, SMALL, _main_ok, _metrics, _ok

    args = [*SMALL, *GAE, "--trainer.iterations", "1", "--trainer.val_before_train", "true"]
    _main_ok(args, tmp_path / "one", capsys)  # in this process; the 2 ranks under torchrun
    _ok(args, tmp_path / "two", nproc=2)
    a, b = _metrics(tmp_path / "one")[1], _metrics(tmp_path / "two")[1]
    keys = [k for k in a if k.startswith(("critic/score", "critic/rewards", "critic/advantages", "critic/returns",
                                          "critic/values", "critic/vf_explained", "response_length/",
                                          "prompt_length/"))]
    assert len(keys) == 23
    for key in keys:
        assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key

    def gens(d: Path):
        return [json.loads(x) for x in (d / "generations.jsonl").read_text().splitlines()]

    assert [(g["seed"], g["reward"]) for g in gens(tmp_path / "one")] == [(g["seed"], g["reward"])
                                                                          for g in gens(tmp_path / "two")]


@pytest.mark.slow
def test_trainer_wandb_gets_config_name_and_resumes_its_run(tmp_path, fake_wandb):
    from test_trainer import SMALL

    from fastpo.config import to_dict
    from fastpo.config_load import parse_args
    from fastpo.trainer import Trainer

    def trainer(iterations: int, *extra: str) -> Trainer:
        cfg = validate(parse_args([*SMALL, "--trainer.run_dir", str(tmp_path / "exp-7"), "--trainer.iterations",
                                   str(iterations), "--trainer.val_before_train", "false", "--trainer.log_wandb",
                                   "true", "--trainer.log_console", "false", *extra]), 1)
        return Trainer(cfg)

    first = trainer(1)
    first.train()
    first.save()
    first.close(export=False)
    init = fake_wandb.runs[0].kwargs
    assert init["name"] == "exp-7" and init["config"] == to_dict(first.cfg)
    # the last-iteration validation's generations table, then the iteration's metrics, both at step 1
    (s1, gens), (s2, scalars) = fake_wandb.runs[0].logged
    assert s1 == s2 == 1 and len(gens["val/generations"].data) == 4 and "actor/pg_loss" in scalars
    resumed = trainer(2, "--trainer.run_name", "renamed")
    assert resumed.step == 1 and fake_wandb.runs[1].kwargs["id"] == init["id"]
    assert fake_wandb.runs[1].kwargs["name"] == "renamed"
    resumed.close(export=False)
    trainer(2, "--trainer.resume", "never", "--trainer.overwrite", "true").close(export=False)
    assert fake_wandb.runs[2].kwargs["id"] != init["id"]
