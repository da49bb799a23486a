"""Build the C++ core with AddressSanitizer + UBSan and run a C++-vs-twin check against it in a subprocess."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CHECK = textwrap.dedent(
    """
    import glob, importlib.util, sys
    import numpy as np
    import fastpo

    path = glob.glob(sys.argv[1] + "/fastpo/_C*.so")[0]
    spec = importlib.util.spec_from_file_location("fastpo._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["fastpo._C"] = module
    fastpo._C = module
    import fastpo.envs as envs
    from fastpo import _C
    assert _C.__file__ == path

    rng = np.random.default_rng(0)
    cases = [
        ("sokoban", {}), ("sokoban", {"dim_room": (8, 8), "num_boxes": 2, "search_depth": 10, "num_threads": 3}),
        ("sokoban", {"dim_room": (7, 5), "num_boxes": 2}), ("frozenlake", {"num_threads": 2}),
        ("frozenlake", {"size": 8, "is_slippery": False}),
    ]
    for name, cfg in cases:
        a, b = envs.make(name, 40, backend="cpp", **cfg), envs.make(name, 40, backend="python", **cfg)
        for _ in range(3):
            seeds = rng.integers(-2**62, 2**62, 40)
            assert a.reset(seeds) == b.reset(seeds)
            for t in range(12):
                acts = rng.integers(-2, 7, 40).astype(np.int32)
                x, y = a.step(acts), b.step(acts)
                assert x[0] == y[0] and all(np.array_equal(x[k], y[k]) for k in (1, 2, 3))
                assert all(np.array_equal(x[4][k], y[4][k]) for k in y[4])
                assert np.array_equal(a.state_keys(), b.state_keys())
            mask = rng.random(40) < 0.5
            assert a.reset(seeds + 1, mask) == b.reset(seeds + 1, mask)
            sa, sb = a.get_state(), b.get_state()
            assert all(np.array_equal(sa[k], sb[k]) for k in sb)
    # RAGEN-2's games: 2048 and the cube (integer actions, some past the action list), Sudoku (text actions)
    for name in ("game_2048", "rubikscube"):
        a, b = envs.make(name, 16, backend="cpp"), envs.make(name, 16, backend="python")
        n = len(a.action_names)
        for _ in range(3):
            seeds = rng.integers(-2**62, 2**62, 16)
            assert a.reset(seeds) == b.reset(seeds)
            for t in range(25):
                acts = rng.integers(0, n + 2, 16).astype(np.int32)
                x, y = a.step(acts), b.step(acts)
                assert x[0] == y[0] and all(np.array_equal(x[k], y[k]) for k in (1, 2, 3)), name
            sa, sb = a.get_state(), b.get_state()
            assert all(np.array_equal(sa[k], sb[k]) for k in sb), name
    a, b = envs.make("sudoku", 8, backend="cpp"), envs.make("sudoku", 8, backend="python")
    seeds = rng.integers(0, 2**40, 8)
    assert a.reset(seeds) == b.reset(seeds)
    for t in range(15):
        texts = [f"{rng.integers(0, 11)},{rng.integers(0, 11)},{rng.integers(-1, 11)}" if rng.random() < 0.9
                 else "x,1" for _ in range(8)]
        x, y = a.step(texts), b.step(texts)
        assert x[0] == y[0] and all(np.array_equal(x[k], y[k]) for k in (1, 2, 3))
    # Layouts without border walls (edge checks), and the standalone generators.
    a = envs.make("sokoban", 2, backend="cpp", dim_room=(4, 4), max_steps=50)
    a.reset_from_layouts(["PX_O\\n____\\n____\\n____", "____\\n____\\n____\\nXPO_"])
    for act in [1, 2, 3, 4] * 5:
        a.step(np.full(2, act, dtype=np.int32))
    for seed in range(200):
        _C.generate_sokoban(seed, 10, 10, 3, 100)
        _C.generate_frozenlake(seed, 12, 0.5)
    # An exception thrown inside a worker thread reaches Python intact.
    try:
        envs.make("sokoban", 8, backend="cpp", dim_room=(4, 4), num_boxes=2, num_gen_steps=1, num_threads=2).reset(
            np.arange(8))
    except RuntimeError as e:
        assert "could not generate" in str(e)
    else:
        raise AssertionError("expected a generation failure")
    print("ASAN-CHECK-OK")
    """
)


@pytest.mark.slow
@pytest.mark.asan
def test_sanitized_build_matches_twin(tmp_path):
    # libstdc++ is preloaded too: ASan resolves its __cxa_throw interceptor at start-up, before Python
    # would load libstdc++ with the extension (C++ exceptions abort otherwise).
    preload = [
        subprocess.run(["g++", f"-print-file-name={lib}"], capture_output=True, text=True).stdout.strip()
        for lib in ("libasan.so", "libstdc++.so")
    ]
    if shutil.which("cmake") is None or not all(os.path.isabs(p) and os.path.exists(p) for p in preload):
        pytest.skip("needs cmake and g++ with libasan")
    lib, temp = tmp_path / "lib", tmp_path / "temp"
    env = dict(os.environ, FASTPO_CMAKE_ARGS="-DFASTPO_SANITIZE=ON")
    build = subprocess.run(
        [sys.executable, "setup.py", "--quiet", "build_ext", "--build-lib", str(lib), "--build-temp", str(temp)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (so,) = lib.glob("fastpo/_C*.so")
    assert "libasan" in subprocess.run(["ldd", str(so)], capture_output=True, text=True).stdout  # really sanitized
    script = tmp_path / "check.py"
    script.write_text(CHECK)
    run_env = dict(
        os.environ,
        LD_PRELOAD=" ".join(preload),
        ASAN_OPTIONS="detect_leaks=0:abort_on_error=0",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
    )
    result = subprocess.run([sys.executable, str(script), str(lib)], env=run_env, capture_output=True, text=True)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-5000:]
    assert "ASAN-CHECK-OK" in result.stdout
    assert "AddressSanitizer" not in output and "runtime error:" not in output, output[-5000:]
