"""GiGPO end to end: ``python -m fastpo.train --preset tiny --algorithm.adv_estimator gigpo`` shortened (4 groups x 4
rollouts of up to 5 FrozenLake turns, 2 iterations, no validation), in a subprocess like a user's run."""

import json
import math
import os
import signal
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_gigpo_tiny_run_end_to_end(tmp_path):
    run_dir = tmp_path / "gigpo"
    args = ["--preset", "tiny", "--algorithm.adv_estimator", "gigpo", "--env.env_groups", "4", "--env.group_size",
            "4", "--optim.mini_batch_size", "8", "--trainer.iterations", "2", "--trainer.val_before_train", "false",
            "--trainer.val_every", "0", "--trainer.run_dir", str(run_dir)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    # cwd outside the repository root (see tests/test_trainer.py: ./kernels would shadow HF's `kernels` probe)
    proc = subprocess.Popen([sys.executable, "-m", "fastpo.train", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"training timed out:\n{err.decode()[-3000:]}")
    assert proc.returncode == 0, f"stdout:\n{out.decode()[-3000:]}\nstderr:\n{err.decode()[-5000:]}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]  # both iterations updated the policy
    names = ("adv/gigpo_nonsingleton_turn_fraction", "adv/gigpo_nonsingleton_later_turn_fraction",
             "adv/gigpo_step_group_size", "adv/gigpo_step_abs_mean", "actor/pg_loss", "actor/grad_norm")
    for r in rows:
        for name in names:
            assert math.isfinite(r[name]), (r["step"], name, r.get(name))
        assert 0 <= r["adv/gigpo_nonsingleton_later_turn_fraction"] <= 1 and r["adv/gigpo_step_group_size"] >= 1
    # the step level did something: states reached after a move were shared by several turns, and the step
    # advantages were not all 0 (returns differed within step groups)
    assert max(r["adv/gigpo_nonsingleton_later_turn_fraction"] for r in rows) > 0
    assert max(r["adv/gigpo_step_abs_mean"] for r in rows) > 0.05
    assert (run_dir / "hf" / "model.safetensors").exists()
