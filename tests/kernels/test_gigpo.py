"""GiGPO estimator (fastpo.kernels.gigpo_advantages): both backends against hand-computed cases and an independent
formula-level re-implementation (plain Python loops over trajectories, turns and tokens, fp64; no shared code)."""

import math
import random

import pytest
import torch

import fastpo.kernels as K

# ---------------------------------------------------------------------------------------------- the truth


def _normalise(values, norm_by_std, eps):
    """One group's list of numbers -> list of advantages (mean-only, or / (unbiased std + eps); one member -> 0)."""
    n = len(values)
    mean = sum(values) / n
    if not norm_by_std:
        return [v - mean for v in values]
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return [(v - mean) / (std + eps) for v in values]


def gigpo_truth(trajs, w, gamma, norm_by_std, eps=1e-6):
    """trajs: list of dicts {score, group, turns: [(key, reward, [mask bits of the turn's tokens])],
    orphan: [mask bits of tokens outside any turn]} -> per-trajectory list of token advantages (turn tokens in
    order, then the orphans)."""
    by_group = {}
    for i, t in enumerate(trajs):
        by_group.setdefault(t["group"], []).append(i)
    episode = {}
    for members in by_group.values():
        for i, a in zip(members, _normalise([trajs[i]["score"] for i in members], norm_by_std, eps), strict=True):
            episode[i] = a
    returns = {}
    for i, t in enumerate(trajs):
        g = 0.0
        for k in reversed(range(len(t["turns"]))):
            g = t["turns"][k][1] + gamma * g
            returns[(i, k)] = g
    step_groups = {}
    for i, t in enumerate(trajs):
        for k, (key, _, _) in enumerate(t["turns"]):
            step_groups.setdefault((t["group"], key), []).append((i, k))
    step = {}
    for members in step_groups.values():
        for ik, a in zip(members, _normalise([returns[ik] for ik in members], norm_by_std, eps), strict=True):
            step[ik] = a
    out = []
    for i, t in enumerate(trajs):
        row = []
        for k, (_, _, bits) in enumerate(t["turns"]):
            row += [(episode[i] + w * step[(i, k)]) if b else 0.0 for b in bits]
        row += [0.0 for _ in t.get("orphan", [])]
        out.append(row)
    return out, step


def pack(trajs, device):
    """The flat tensors of trajs (same token order as gigpo_truth)."""
    scores = torch.tensor([t["score"] for t in trajs], dtype=torch.float32)
    groups = torch.tensor([t["group"] for t in trajs], dtype=torch.int64)
    keys, rewards, cu, tids, mask = [], [], [0], [], []
    for t in trajs:
        for key, reward, bits in t["turns"]:
            tids += [len(keys)] * len(bits)
            mask += bits
            keys.append(key)
            rewards.append(reward)
        cu.append(len(keys))
        tids += [-1] * len(t.get("orphan", []))
        mask += t.get("orphan", [])
    tensors = (scores, groups, torch.tensor(keys, dtype=torch.int64), torch.tensor(rewards, dtype=torch.float32),
               torch.tensor(cu, dtype=torch.int64), torch.tensor(tids, dtype=torch.int64),
               torch.tensor(mask, dtype=torch.bool))
    return [x.to(device) for x in tensors]


def run(trajs, device, **kw):
    adv, step, size = K.gigpo_advantages(*pack(trajs, device), **kw)
    return adv.cpu(), step.cpu(), size.cpu()


def flat(rows):
    return torch.tensor([x for row in rows for x in row], dtype=torch.float64)


# ------------------------------------------------------------------------------------------- hand cases
A, B = 2**63 - 1, -(2**63)  # extreme int64 keys (uint64 keys arrive viewed as int64)
HAND = [
    {"score": 3.0, "group": 0, "turns": [(A, 1.0, [0, 1, 1]), (B, 2.0, [1, 1])]},
    {"score": 1.0, "group": 0, "turns": [(A, 0.0, [0, 1]), (A, 1.0, [1])]},  # state A reached twice
    {"score": 2.0, "group": 0, "turns": [(A, 2.0, [1, 1])]},
    {"score": 5.0, "group": 1, "turns": [(A, 5.0, [0, 1])]},  # same key, other group: a group of one
    {"score": -1.0, "group": 7, "turns": [], "orphan": [0, 1]},  # no turn at all (its trained token gets 0)
]


def test_hand_case_mean(backend, device):
    """gamma 0.5: G = traj0 [2, 2], traj1 [0.5, 1], traj2 [2], traj3 [5]. Episode (group 0 mean 2): [1, -1, 0];
    groups of one: 0. Step group (0, A) = {2, 0.5, 1, 2}, mean 1.375; (0, B) and (1, A) are singletons: 0."""
    adv, step, size = run(HAND, device, step_gamma=0.5, norm_by_std=False)
    assert step.tolist() == [0.625, 0.0, -0.875, -0.375, 0.625, 0.0]
    assert size.tolist() == [4, 1, 4, 4, 4, 1]
    want = [0, 1.625, 1.625, 1, 1] + [0, -1.875, -1.375] + [0.625, 0.625] + [0, 0] + [0, 0]
    assert adv.tolist() == want


def test_hand_case_mean_std_and_weight(backend, device):
    """Step group (0, A): returns {2, 0.5, 1, 2}, unbiased std sqrt(0.5625) = 0.75; episode group 0: std 1."""
    adv, step, _ = run(HAND, device, step_gamma=0.5, step_weight=0.5, norm_by_std=True)
    eps = 1e-6
    s = [0.625 / (0.75 + eps), 0.0, -0.875 / (0.75 + eps), -0.375 / (0.75 + eps), 0.625 / (0.75 + eps), 0.0]
    torch.testing.assert_close(step, torch.tensor(s), rtol=1e-6, atol=1e-6)
    e = [1 / (1 + eps), -1 / (1 + eps), 0.0]
    want = [0, e[0] + 0.5 * s[0], e[0] + 0.5 * s[0], e[0], e[0], 0, e[1] + 0.5 * s[2], e[1] + 0.5 * s[3],
            e[2] + 0.5 * s[4], e[2] + 0.5 * s[4], 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(want), rtol=1e-6, atol=1e-6)


def test_equal_returns_and_gamma_zero(backend, device):
    """gamma 0: the step return is the turn's own reward; equal returns in a step group give 0 (not 0 / eps)."""
    trajs = [{"score": s, "group": 3, "turns": [(11, 1.0, [1]), (12, r, [1])]} for s, r in ((1.0, 0.5), (4.0, 0.5))]
    adv, step, size = run(trajs, device, step_gamma=0.0, norm_by_std=True)
    assert step.tolist() == [0.0] * 4 and size.tolist() == [2] * 4
    e = 1.5 / (math.sqrt(4.5) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([-e, -e, e, e]), rtol=1e-6, atol=1e-6)


def test_empty_inputs(backend, device):
    """An all-false mask, a batch without turns and an empty batch all give zeros of the right shapes."""
    masked = [{"score": float(i), "group": 0, "turns": [(i % 2, 1.0, [0, 0])]} for i in range(3)]
    adv, step, _ = run(masked, device)
    assert adv.tolist() == [0.0] * 6 and step.shape == (3,)
    no_turns = [{"score": float(i), "group": 0, "turns": [], "orphan": [1, 1]} for i in range(2)]
    adv, step, size = run(no_turns, device)
    assert adv.tolist() == [0.0] * 4 and step.shape == (0,) and size.shape == (0,)
    adv, step, size = run([], device)
    assert adv.shape == (0,) and step.shape == (0,) and size.shape == (0,)


# ----------------------------------------------------------------------------------------- random inputs
def random_trajs(rng, n_groups, group_size, max_turns, n_keys):
    trajs = []
    for g in rng.sample(range(-50, 50), n_groups):  # arbitrary, unsorted group labels
        for _ in range(group_size):
            turns = []
            for _ in range(rng.randint(0, max_turns)):
                bits = [int(rng.random() < 0.7) for _ in range(rng.randint(1, 5))]
                turns.append((rng.randrange(n_keys) * 7919 - 3, round(rng.uniform(-1, 1), 3), bits))
            trajs.append({"score": round(rng.uniform(-2, 10), 3), "group": g, "turns": turns,
                          "orphan": [int(rng.random() < 0.3) for _ in range(rng.randint(0, 2))]})
    rng.shuffle(trajs)  # group members need not be adjacent
    return trajs


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_matches_truth(backend, device, norm_by_std, seed):
    rng = random.Random(seed)
    trajs = random_trajs(rng, n_groups=5, group_size=4, max_turns=5, n_keys=4)
    w, gamma = rng.uniform(0.2, 2.0), rng.uniform(0.5, 1.0)
    adv, step, size = run(trajs, device, step_weight=w, step_gamma=gamma, norm_by_std=norm_by_std)
    rows, step_truth = gigpo_truth(trajs, w, gamma, norm_by_std)
    torch.testing.assert_close(adv.double(), flat(rows), rtol=1e-5, atol=1e-5)
    want = [step_truth[(i, k)] for i, t in enumerate(trajs) for k in range(len(t["turns"]))]
    torch.testing.assert_close(step.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    assert (size > 1).any() and (size == 1).any()  # both kinds of step group are exercised


@pytest.mark.parametrize("n_groups,max_turns", [(16, 5), (33, 1)])
def test_triton_equals_torch_on_a_realistic_batch(device, monkeypatch, n_groups, max_turns):
    """16 groups x 8 trajectories x up to 5 turns (more turns than one tile of the step kernel), and 264
    trajectories (more than one tile of the episode kernel): the two backends agree (fp32 kernel vs fp64)."""
    trajs = random_trajs(random.Random(5), n_groups=n_groups, group_size=8, max_turns=max_turns, n_keys=6)
    outs = {}
    for name in ("torch", "triton"):
        monkeypatch.setenv("FASTPO_KERNELS", name)
        outs[name] = run(trajs, device, step_weight=1.0, step_gamma=0.95)
    for a, b in zip(outs["torch"], outs["triton"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------- errors
def test_bad_inputs_are_named():
    args = pack(HAND, "cpu")
    scores, groups, keys, rewards, cu, tids, mask = args
    with pytest.raises(ValueError, match="cu_turns must start at 0.*end at M = 6"):
        K.gigpo_advantages(scores, groups, keys, rewards, torch.tensor([0, 2, 4, 5, 6, 5]), tids, mask)
    with pytest.raises(ValueError, match=r"turn_ids must lie in \[-1, 6\)"):
        K.gigpo_advantages(scores, groups, keys, rewards, cu, tids.clone().fill_(6), mask)
    with pytest.raises(ValueError, match=r"step_gamma must lie in \[0.0, 1.0\], got 1.5"):
        K.gigpo_advantages(*args, step_gamma=1.5)
    with pytest.raises(ValueError, match="turn_keys must be an integer tensor"):
        K.gigpo_advantages(scores, groups, keys.float(), rewards, cu, tids, mask)
    with pytest.raises(ValueError, match="cu_turns must have len"):
        K.gigpo_advantages(scores, groups, keys, rewards, cu[:-1], tids, mask)
