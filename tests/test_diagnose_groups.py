"""bench/diagnose_groups.py: the trainer's rollout of one iteration, the filter's choice and the advantage sums."""

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_sums_of_one_iteration(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import diagnose_groups

    assert diagnose_groups.main(["--preset", "tiny", "--env.env_groups", "4", "--env.group_size", "4",
                                 "--env.val_groups", "4", "--optim.mini_batch_size", "8", "--iterations", "1",
                                 "--quiet"]) == 0
    out = capsys.readouterr().out
    sums = {m[1].strip(): float(m[2]) for m in re.finditer(r"^(\w+: [^\n]*?)\s+(-?\d+\.\d+)$", out, re.M)}
    groups = re.findall(r"^group\s+\d+ (kept|    ) success (\d+)/4", out, re.M)
    assert len(groups) == 4 and sum(k == "kept" for k, _ in groups) == 2  # the tiny preset keeps half the groups
    kept = sum(sums.get(f"{s}: trajectories", 0.0) for s in ("success", "failure"))
    assert kept == 8.0
    # GRPO's advantages sum to zero within a group: per trajectory, what successes gain failures lose
    assert abs(sums.get("success: sum A (grpo, per trajectory)", 0.0) +
               sums.get("failure: sum A (grpo, per trajectory)", 0.0)) < 1e-3
