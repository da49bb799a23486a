"""Static GPU check: every Triton kernel of fastpo.kernels, in every specialisation the library launches on CUDA,
compiled ahead of time for sm_90a and sm_80 with the ptxas bundled in triton; no GPU needed.

The test session runs with TRITON_INTERPRET=1 (tests/conftest.py), where ``@triton.jit`` gives InterpretedFunction
objects that cannot be compiled. So the compile runs once per session in a subprocess without that variable
(``python -m fastpo.kernels.aot --json``, the same command that prints the table of docs/KERNELS.md), and each
(specialisation, arch) pair is one test reading its result. Discovery and the spec list are also checked
in-process, on the interpreter's wrappers (they keep the Python function and its argument names).
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastpo.kernels import aot
from fastpo.kernels.ops import logprob

DOCS = Path(__file__).resolve().parents[2] / "docs" / "KERNELS.md"
SPECS = aot.specs()
CASES = [(s.key, arch) for s in SPECS for arch in aot.ARCHS if not s.archs or arch in s.archs]


@pytest.fixture(scope="session")
def compiled(tmp_path_factory):
    """{(spec key, arch): result dict} from one subprocess compile of everything (Triton's cache makes reruns
    cheaper; the first run compiles ~270 variants on the available CPUs). Once per test run, not once per
    pytest-xdist worker: the first worker to get here compiles under a file lock in the folder the workers share,
    the others read its output."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent  # every worker's basetemp lies in one folder of this run
    result = shared / "aot_compile.jsonl"
    with FileLock(str(result) + ".lock"):
        if not result.exists():
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            out = subprocess.run([sys.executable, "-m", "fastpo.kernels.aot", "--json"], capture_output=True,
                                 text=True, timeout=1500, env=env)
            assert out.returncode in (0, 1), out.stderr[-4000:]
            result.write_text(out.stdout)
    rows = [json.loads(line) for line in result.read_text().splitlines() if line.startswith("{")]
    return {(r["key"], r["arch"]): r for r in rows}


def test_every_jit_kernel_is_registered_and_helpers_are_told_apart():
    found = aot.discover()
    assert aot.unregistered(found) == []
    assert {"logprob._flp_fwd_kernel", "losses._ppo_fwd_kernel", "advantages._gae_kernel"} <= set(found["kernels"])
    # inlined device functions: called by a kernel, or passed to tl.associative_scan
    assert set(found["helpers"]) == {
        "advantages._affine2", "advantages._affine3", "advantages._last", "advantages._same_group",
        "advantages._group_advantage", "losses._ppo_token", "logprob._dot_acc", "logprob._xw_step", "logprob._fwd_item",
        "logprob._logits_tile", "logprob._lse_update", "logprob._store_partials", "logprob._grad_tile_coords",
        "logprob._grad_tile_store"}
    assert {"flp_persistent._flp_fwd_persistent_kernel", "flp_persistent._flp_grad_persistent_kernel"} <= set(
        found["kernels"])
    assert {s.kernel for s in SPECS} == set(found["kernels"])


def test_a_new_kernel_without_specialisations_fails():
    found = aot.discover()
    extra = dict(found, kernels=dict(found["kernels"], **{"logprob._new_kernel": found["kernels"][
        "logprob._flp_fwd_kernel"]}))
    assert aot.unregistered(extra) == ["logprob._new_kernel"]
    with pytest.raises(ValueError, match="logprob._new_kernel"):
        aot.specs(extra)


def test_specs_use_the_shipped_cuda_configs():
    by_key = {s.key: s for s in SPECS}
    half = by_key["logprob._flp_fwd_kernel[bf16 bias WANT_ENT aligned]"]
    cfg = logprob.gpu_config("fwd", "half")
    assert (half.constexprs["BLOCK_N"], half.constexprs["BLOCK_V"], half.constexprs["BLOCK_K"], half.num_warps) == (
        cfg["BLOCK_N"], cfg["BLOCK_V"], cfg["BLOCK_K"], cfg["num_warps"])
    tf32 = by_key["logprob._flp_grad_kernel[fp32 bias HAS_GENT aligned]"]
    assert tf32.constexprs["PREC"] == "tf32" and not tf32.constexprs["DOT_F32"] and tf32.tensor_cores
    exact = by_key["logprob._flp_grad_kernel[fp32-exact bias HAS_GENT ragged]"]
    assert exact.constexprs["PREC"] == "ieee" and exact.constexprs["DOT_F32"] and not exact.tensor_cores
    assert "N" not in exact.divisible and "H" in exact.divisible and "x_ptr" in exact.divisible
    labels = {s.label for s in SPECS if s.kernel == "logprob._flp_fwd_kernel"}
    assert {f"{dt} bias WANT_ENT aligned" for dt in ("bf16", "fp16", "fp32", "fp32-exact")} <= labels


def test_persistent_specs_compile_tma_for_sm90a_only():
    """The persistent kernels ship their own configs; their TMA variants are compiled for sm_90a alone (sm_80 has
    no TMA: the launcher gives it the pointer variant, compiled for both)."""
    from fastpo.kernels.ops import flp_persistent

    by_key = {s.key: s for s in SPECS}
    for kernel, kind, switch in (("_flp_fwd_persistent_kernel", "fwd", "WANT_ENT"),
                                 ("_flp_grad_persistent_kernel", "grad", "HAS_GENT")):
        cfg = flp_persistent.gpu_config(kind, "half")
        tma = by_key[f"flp_persistent.{kernel}[bf16 tma bias {switch} aligned]"]
        ptr = by_key[f"flp_persistent.{kernel}[bf16 bias {switch} aligned]"]
        assert tma.archs == ("sm_90a",) and ptr.archs == () and tma.constexprs["USE_TMA"]
        assert not ptr.constexprs["USE_TMA"] and ptr.constexprs["NUM_STAGES"] == cfg["num_stages"] == ptr.num_stages
        assert (ptr.constexprs["BLOCK_N"], ptr.constexprs["BLOCK_K"], ptr.num_warps) == (
            cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"])
    assert all(arch == "sm_90a" for key, arch in CASES if " tma " in key)


@pytest.mark.slow
@pytest.mark.parametrize(("key", "arch"), CASES, ids=[f"{k}-{a}" for k, a in CASES])
def test_compiles_without_spills(compiled, key, arch):
    r = compiled.get((key, arch))
    assert r is not None, f"{key} was not compiled for {arch}"
    assert r["error"] is None, r["error"]
    assert (r["spill_stores"], r["spill_loads"]) == (0, 0), f"{key} spills on {arch}: {r}"
    assert 0 < r["regs"] <= 255 and r["ctas_per_sm"] >= 1, r
    if r["expect_tensor_cores"]:
        assert r["tensor_cores"] == aot.ARCHS[arch][3], f"{key} on {arch}: no tensor-core instructions ({r})"
    else:
        assert r["tensor_cores"] == "-", r


def test_docs_table_lists_every_specialisation():
    """docs/KERNELS.md carries the generated table: every specialisation has a row, so a new kernel or config
    comes with its resource figures (regenerate with ``python -m fastpo.kernels.aot``)."""
    rows = {tuple(c.strip() for c in line.split("|")[1:3]) for line in DOCS.read_text().splitlines()
            if re.match(r"\| _\w+_kernel \|", line)}
    missing = [s.key for s in SPECS if (s.kernel.split(".")[-1], s.label) not in rows]
    assert missing == [], f"docs/KERNELS.md lacks rows for {missing}"


def test_ptxas_report_parsing():
    log = ("ptxas info    : Compiling entry function '_flp_fwd_kernel' for 'sm_80'\n"
           "ptxas info    : Function properties for _flp_fwd_kernel\n"
           "    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 8 bytes cumulative stack size\n")
    assert aot._ptxas_report(log) == (255, 8, 4)
    with pytest.raises(RuntimeError, match="unexpected ptxas"):
        aot._ptxas_report("ptxas fatal")


def test_occupancy():
    # sm_90a figures of the table: 215 regs x 8 warps (1 CTA by registers), 254 regs x 4 warps (2 CTAs)
    assert logprob.ctas_per_sm(215, 8, 98304) == 1
    assert logprob.ctas_per_sm(254, 4, 73728) == 2
    assert logprob.ctas_per_sm(128, 4, 73728) == 3  # shared memory bound: 228 KiB / (72 + 1) KiB
    assert logprob.ctas_per_sm(32, 1, 0) == 32  # the per-SM CTA cap
    assert logprob.ctas_per_sm(255, 8, 65536, smem_per_sm=167936) == 1


def test_vocab_splits_leave_no_mostly_idle_wave():
    slots = 132  # H100 / H200 SMs x 1 CTA per SM of the 8-warp tiles
    busy = lambda blocks, s: blocks * s / (math.ceil(blocks * s / slots) * slots)  # noqa: E731
    assert logprob.n_splits(32, 1187, slots) == 4  # 4K tokens of 128: 128 CTAs, one wave
    assert logprob.n_splits(2, 3, slots) == 3  # no more splits than vocab blocks
    assert logprob.n_splits(1, 1187, slots, max_splits=8) == 8
    assert logprob.n_splits(200, 1187, 132) == 7  # 1400 CTAs: 10.6 waves; s = 1 would be 2 waves, 1.5 used
    old_rule = lambda blocks: max(1, -(-2 * slots // blocks))  # noqa: E731  (before: 2 x SMs CTAs)
    assert min(busy(b, old_rule(b)) for b in range(1, 200)) < 0.7
    assert min(busy(b, logprob.n_splits(b, 1187, slots)) for b in range(3, 3000)) > 0.94
    with pytest.raises(ValueError, match="slots=0"):
        logprob.n_splits(4, 10, 0)


def test_fp32_dot_mode_option(monkeypatch):
    import torch

    monkeypatch.delenv("FASTPO_KERNELS_FP32", raising=False)
    assert logprob.fp32_mode() == "tf32"
    monkeypatch.setenv("FASTPO_KERNELS_FP32", "ieee")
    assert logprob.fp32_mode() == "ieee"
    assert logprob.gpu_config("fwd", "ieee")["PREC"] == "ieee" and logprob.gpu_config("fwd", "ieee")["DOT_F32"]
    # CPU tensors (the interpreter) are always exact, whatever the option
    assert logprob._cfg(torch.zeros(1, dtype=torch.bfloat16))["PREC"] == "ieee"
    monkeypatch.setenv("FASTPO_KERNELS_FP32", "fp16")
    with pytest.raises(ValueError, match=r"FASTPO_KERNELS_FP32 must be one of \('tf32', 'ieee'\).*'fp16'"):
        logprob.fp32_mode()
    with pytest.raises(ValueError, match="kind must be"):
        logprob.gpu_config("bwd", "half")
