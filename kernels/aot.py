"""Ahead-of-time compile check of every Triton kernel in ``fastpo.kernels`` for CUDA targets, without a GPU.

``triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", cc, 32))`` lowers a
kernel to PTX and assembles it with the ``ptxas`` bundled in the triton wheel; no driver and no device are
involved. This module lists the specialisations the library launches on CUDA (:func:`specs`: operand dtypes,
constexpr switches, the shipped tile configs of ``ops/logprob.py``, 16-divisible and ragged integer arguments),
compiles each for sm_90a and sm_80 and reads, per specialisation, registers and spill bytes (``ptxas -v``),
shared memory (Triton's metadata), the tensor-core instructions in the PTX (``wgmma`` on sm_90a, ``mma.sync`` on
sm_80) and the resulting CTAs per SM.

Every ``@triton.jit`` function in the package is found by :func:`discover`; one that no other jit function calls
is a launched kernel and must have an entry in ``_BUILDERS``, so a new kernel without one fails the check
(``tests/kernels/test_gpu_compile.py``). Compiling needs the real ``JITFunction`` objects, so it must run in a
process where ``TRITON_INTERPRET`` is unset: the test runs ``python -m fastpo.kernels.aot --json`` in a
subprocess. ``python -m fastpo.kernels.aot`` prints the markdown table of docs/KERNELS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from typing import Any

#: The compile targets: name -> (compute capability, registers per SM, shared memory per SM in bytes, the
#: tensor-core instruction expected in the PTX). H100/H200 (sm_90a) and A100 (sm_80) figures.
ARCHS = {
    "sm_90a": (90, 65536, 233472, "wgmma"),
    "sm_80": (80, 65536, 167936, "mma"),
}
_MAX_THREADS_PER_SM = 2048
_INT_ARG = "i32"  # what Triton's launcher passes for an int argument below 2**31


@dataclasses.dataclass(frozen=True)
class Spec:
    """One specialisation of a kernel as launched on CUDA.

    ``signature`` maps every runtime argument to its Triton type (``*bf16``, ``i32``, ``fp32``...); ``constexprs``
    the compile-time ones; ``divisible`` the arguments Triton's launcher would mark 16-divisible (aligned pointers,
    integers that are multiples of 16); ``tensor_cores`` whether the kernel must emit tensor-core instructions;
    ``archs`` the targets it is launched on (empty: every one of ARCHS)."""

    kernel: str
    label: str
    signature: dict
    constexprs: dict
    divisible: tuple
    num_warps: int = 4
    num_stages: int = 3
    tensor_cores: bool = False
    archs: tuple = ()  # the ARCHS it is compiled for; empty: all (a TMA path exists on sm_90a only)

    @property
    def key(self) -> str:
        return f"{self.kernel}[{self.label}]"


@dataclasses.dataclass
class Result:
    """What one compile of a Spec for one arch gave: registers / spill bytes per thread from ptxas, shared
    memory per CTA in bytes, the tensor-core instruction found in the PTX (``wgmma``, ``mma`` or ``-``), CTAs per
    SM from those resources, and the compile error (None when it compiled)."""

    key: str
    arch: str
    regs: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    shared: int = 0
    tensor_cores: str = "-"
    ctas_per_sm: int = 0
    num_warps: int = 0
    expect_tensor_cores: bool = False
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Compiled, no spill, and tensor-core instructions where the spec asks for them."""
        want = ARCHS[self.arch][3]
        return (self.error is None and self.spill_stores == 0 and self.spill_loads == 0
                and (not self.expect_tensor_cores or self.tensor_cores == want))


# ------------------------------------------------------------------------------------------- discovery
def _is_jit(obj: object) -> bool:
    # JITFunction normally; InterpretedFunction when TRITON_INTERPRET=1 was set before the kernels were imported
    return type(obj).__name__ in ("JITFunction", "InterpretedFunction") and hasattr(obj, "fn")


def discover() -> dict[str, dict[str, object]]:
    """Every ``@triton.jit`` function of the package's modules: {"kernels": {name: fn}, "helpers": {name: fn}}.
    A helper is a jit function that another jit function of its module names in its body (a call, or a
    ``tl.associative_scan`` combine function): it is inlined there and compiled with it. Every other one is a
    launched kernel. Names are ``module.function``."""
    import fastpo.kernels as package

    found: dict[str, tuple[str, object]] = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if info.name.endswith(".aot"):
            continue
        module = importlib.import_module(info.name)
        for attr, obj in vars(module).items():
            if _is_jit(obj) and getattr(obj.fn, "__module__", None) == module.__name__:
                found[f"{info.name.rsplit('.', 1)[-1]}.{attr}"] = (module.__name__, obj)
    sources = {name: inspect.getsource(obj.fn) for name, (_, obj) in found.items()}
    kernels, helpers = {}, {}
    for name, (module, obj) in found.items():
        short = name.rsplit(".", 1)[-1]
        called = any(re.search(rf"\b{re.escape(short)}\b", src.split(":", 1)[1])
                     for other, src in sources.items() if other != name and found[other][0] == module)
        (helpers if called else kernels)[name] = obj
    return {"kernels": kernels, "helpers": helpers}


# ------------------------------------------------------------------------------------ specialisations
_DT = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def _spec(kernel: str, label: str, fn_args: list[str], types: dict[str, str], constexprs: dict, aligned: bool,
          always: tuple[str, ...] = (), **kw: Any) -> Spec:
    """types: runtime argument -> Triton type; pointers are always 16-aligned (fresh torch allocations),
    integers only in the aligned variant (plus the ``always`` ones, e.g. a model's hidden size)."""
    sig = {a: types[a] for a in fn_args if a not in constexprs}
    sig.update({a: "constexpr" for a in constexprs})
    div = tuple(a for a, t in types.items() if t.startswith("*") or (t == _INT_ARG and (aligned or a in always)))
    return Spec(kernel, label + (" aligned" if aligned else " ragged"), sig, dict(constexprs), div, **kw)


def _args(fn: Any) -> list[str]:
    return list(fn.arg_names)


def _selective_specs(name: str, fn: Any, backward: bool) -> list[Spec]:
    from .ops import logprob

    out = []
    for dt in ("bf16", "fp16", "fp32"):
        for aligned in (True, False):
            types = {"logits_ptr": _DT[dt], "ids_ptr": "*i64", "lse_ptr": "*fp32", "logp_ptr": "*fp32",
                     "g_ptr": "*fp32", "glse_ptr": "*fp32", "out_ptr": _DT[dt], "V": _INT_ARG,
                     "rows_per_outer": _INT_ARG, "stride_outer": _INT_ARG, "stride_row": _INT_ARG, "inv_t": "fp32"}
            types = {a: types[a] for a in _args(fn) if a in types}
            out.append(_spec(name, dt, _args(fn), types, {"BLOCK_V": logprob.ROW_BLOCK}, aligned,
                             num_warps=logprob.ROW_WARPS))
    return out


def _flp_specs(name: str, fn: Any, backward: bool, persistent: bool = False) -> list[Spec]:
    """The fused linear-logprob kernels (forward or grad; tiled, or persistent with pointer loads on every arch
    and TMA descriptors on sm_90a) in each dot mode's shipped config."""
    from .ops import flp_persistent, logprob

    out = []
    switch = "HAS_GENT" if backward else "WANT_ENT"
    # tiled: every switch combination on 16-divisible sizes, ragged token / vocab counts with both switches on;
    # persistent (twice as many variants, one per load path): no switch, both switches, both on ragged sizes
    combos = ((False, False, True), (False, True, True), (True, False, True), (True, True, True), (True, True, False))
    if persistent:
        combos = ((False, False, True), (True, True, True), (True, True, False))
    for mode, dt in (("half", "bf16"), ("half", "fp16"), ("tf32", "fp32"), ("ieee", "fp32")):
        cfg = (flp_persistent if persistent else logprob).gpu_config("grad" if backward else "fwd", mode)
        for tma in ((False, True) if persistent else (None,)):
            for bias, second, aligned in combos:
                types = {"x_ptr": _DT[dt], "w_ptr": _DT[dt], "b_ptr": _DT[dt], "ids_ptr": "*i64", "part_ptr": "*fp32",
                         "lse_ptr": "*fp32", "ent_ptr": "*fp32", "g_ptr": "*fp32", "glse_ptr": "*fp32",
                         "gent_ptr": "*fp32", "out_ptr": _DT[dt], "N": _INT_ARG, "V": _INT_ARG, "H": _INT_ARG,
                         "v_per_split": _INT_ARG, "splits": _INT_ARG, "v_lo": _INT_ARG, "Vc": _INT_ARG,
                         "inv_t": "fp32"}
                types = {a: types[a] for a in _args(fn) if a in types}
                const = {"HAS_BIAS": bias, switch: second, "DOT_F32": cfg["DOT_F32"], "PREC": cfg["PREC"],
                         "BLOCK_N": cfg["BLOCK_N"], "BLOCK_V": cfg["BLOCK_V"], "BLOCK_K": cfg["BLOCK_K"]}
                if backward:
                    const["GROUP_V"] = cfg["GROUP_V"]
                if persistent:
                    const.update(USE_TMA=tma, NUM_STAGES=cfg["num_stages"])
                label = (f"{dt}{'-exact' if mode == 'ieee' else ''}{' tma' if tma else ''}{' bias' if bias else ''}"
                         f"{' ' + switch if second else ''}")
                out.append(_spec(name, label, _args(fn), types, const, aligned, always=("H", "v_per_split", "v_lo"),
                                 num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                                 tensor_cores=mode != "ieee", archs=("sm_90a",) if tma else ()))
    return out


def _ppo_specs(name: str, fn: Any) -> list[Spec]:
    from .ops import losses
    from .reference import LOG_RATIO_CLAMP

    out = []
    # (has_ref, kl_type, has_ent, has_is_weight, need_grad); is_weight (the off-policy correction) is fp32
    combos = [(False, 0, False, False, True), (True, 0, True, False, True), (True, 1, True, False, True),
              (True, 1, False, False, True), (False, 0, False, False, False), (True, 1, True, False, False),
              (False, 0, True, True, True), (True, 1, True, True, True)]
    for dt in ("fp32", "bf16"):
        for has_ref, kl, has_ent, isw, grad in combos:
            ragged_too = (has_ref, kl, has_ent, isw, grad) == (True, 1, True, False, True)
            for aligned in ((True, False) if ragged_too else (True,)):
                types = {a: (_DT[dt] if a.endswith("_ptr") else _INT_ARG if a == "N" else "fp32")
                         for a in _args(fn)}
                types.update(mask_ptr="*u8", isw_ptr="*fp32", part_ptr="*fp32", dlp_ptr="*fp32")
                const = {"HAS_REF": has_ref, "KL_TYPE": kl, "HAS_ENT": has_ent, "HAS_ISW": isw, "NEED_GRAD": grad,
                         "LOG_RATIO_CLAMP": LOG_RATIO_CLAMP, "BLOCK": losses.GPU_BLOCK}
                label = f"{dt}{' ref k' + ('3' if kl else '1') if has_ref else ''}{' ent' if has_ent else ''}" \
                        f"{' isw' if isw else ''}{' grad' if grad else ''}"
                out.append(_spec(name, label, _args(fn), {a: types[a] for a in _args(fn) if a not in const}, const,
                                 aligned))
    return out


def _value_specs(name: str, fn: Any) -> list[Spec]:
    from .ops import losses

    out = []
    for dt in ("fp32", "bf16"):
        for grad in (True, False):
            for aligned in (True, False):
                types = {a: (_DT[dt] if a.endswith("_ptr") else _INT_ARG if a == "N" else "fp32")
                         for a in _args(fn) if a not in ("NEED_GRAD", "BLOCK")}
                types.update(mask_ptr="*u8", part_ptr="*fp32", dv_ptr="*fp32")
                out.append(_spec(name, f"{dt}{' grad' if grad else ''}", _args(fn), types,
                                 {"NEED_GRAD": grad, "BLOCK": losses.GPU_BLOCK}, aligned))
    return out


def _gae_specs(name: str, fn: Any) -> list[Spec]:
    from .ops import advantages

    out = []
    for dt in ("fp32", "bf16"):
        for reset in (False, True):
            types = {"r_ptr": _DT[dt], "v_ptr": _DT[dt], "m_ptr": "*u8", "reset_ptr": "*u8", "cu_ptr": "*i64",
                     "adv_ptr": "*fp32", "ret_ptr": "*fp32", "gamma": "fp32", "gl": "fp32"}
            out.append(_spec(name, f"{dt}{' reset' if reset else ''}", _args(fn), types,
                             {"HAS_RESET": reset, "BLOCK_T": advantages.GPU_BLOCK_T}, True))
    return out


def _grpo_specs(name: str, fn: Any) -> list[Spec]:
    from .ops import advantages

    out = []
    for dt in ("fp32", "bf16"):
        for norm in (True, False):
            for aligned in (True, False):
                types = {"score_ptr": _DT[dt], "gid_ptr": "*i64", "mask_ptr": "*u8", "cu_ptr": "*i64",
                         "seq_adv_ptr": "*fp32", "out_ptr": "*fp32", "B": _INT_ARG, "eps": "fp32"}
                const = {"NORM": norm, "BLOCK_B": advantages.GPU_BLOCK_B, "BLOCK_T": advantages.GPU_BLOCK_T}
                out.append(_spec(name, f"{dt}{' norm' if norm else ''}", _args(fn), types, const, aligned))
    return out


def _gigpo_specs(name: str, fn: Any) -> list[Spec]:
    """GiGPO's three kernels (ops/gigpo.py) as launched on CUDA: BLOCK 1024, fp32 scores / turn rewards (the
    launcher casts the [B] / [M] inputs), the NORM switch (mean_std / mean)."""
    out = []
    short = name.rsplit(".", 1)[-1]
    for dt in ("fp32",):
        for norm in ((True, False) if short != "_scatter_kernel" else (None,)):
            for aligned in (True, False):
                types = {"score_ptr": _DT[dt], "gid_ptr": "*i64", "cu_turn_ptr": "*i64", "reward_ptr": _DT[dt],
                         "ep_ptr": "*fp32", "ret_ptr": "*fp32", "B": _INT_ARG, "eps": "fp32", "gamma": "fp32",
                         "key_ptr": "*i64", "tgid_ptr": "*i64", "ttraj_ptr": "*i64", "step_ptr": "*fp32",
                         "size_ptr": "*i64", "turn_adv_ptr": "*fp32", "M": _INT_ARG, "w": "fp32",
                         "tid_ptr": "*i64", "mask_ptr": "*u8", "out_ptr": "*fp32", "N": _INT_ARG}
                const = {k: v for k, v in (("NORM", norm), ("BLOCK_B", 1024), ("BLOCK_M", 1024), ("BLOCK", 1024))
                         if k in _args(fn) and v is not None}
                types = {a: types[a] for a in _args(fn) if a not in const}
                label = f"{dt}{' norm' if norm else ''}"
                out.append(_spec(name, label, _args(fn), types, const, aligned))
    return out


#: kernel (``module.function``) -> builder of its CUDA specialisations (a kernel missing here fails the check).
_BUILDERS = {
    "logprob._selective_fwd_kernel": lambda n, f: _selective_specs(n, f, False),
    "logprob._selective_bwd_kernel": lambda n, f: _selective_specs(n, f, True),
    "logprob._flp_fwd_kernel": lambda n, f: _flp_specs(n, f, False),
    "logprob._flp_grad_kernel": lambda n, f: _flp_specs(n, f, True),
    "flp_persistent._flp_fwd_persistent_kernel": lambda n, f: _flp_specs(n, f, False, persistent=True),
    "flp_persistent._flp_grad_persistent_kernel": lambda n, f: _flp_specs(n, f, True, persistent=True),
    "losses._ppo_fwd_kernel": _ppo_specs,
    "losses._value_fwd_kernel": _value_specs,
    "advantages._gae_kernel": _gae_specs,
    "advantages._grpo_kernel": _grpo_specs,
    "gigpo._episode_kernel": _gigpo_specs,
    "gigpo._step_kernel": _gigpo_specs,
    "gigpo._scatter_kernel": _gigpo_specs,
}


def unregistered(found: dict | None = None) -> list[str]:
    """Launched kernels of the package that have no specialisation builder (should be empty)."""
    found = found or discover()
    return sorted(set(found["kernels"]) - set(_BUILDERS))


def specs(found: dict | None = None) -> list[Spec]:
    """Every CUDA specialisation of every registered kernel; ValueError if a discovered kernel is unregistered."""
    found = found or discover()
    missing = unregistered(found)
    if missing:
        raise ValueError(f"Triton kernels without a specialisation list in fastpo.kernels.aot._BUILDERS: {missing}")
    return [s for name, fn in sorted(found["kernels"].items()) for s in _BUILDERS[name](name, fn)]


# ----------------------------------------------------------------------------------------------- compile
def ctas_per_sm(regs: int, num_warps: int, shared: int, regs_per_sm: int = 65536, smem_per_sm: int = 233472,
                max_threads: int = _MAX_THREADS_PER_SM) -> int:
    """Resident CTAs per SM for a kernel using ``regs`` registers per thread, ``num_warps`` warps and ``shared``
    bytes of shared memory per CTA: registers are allocated per warp in 256-register units (8 per thread), and
    the driver reserves 1 KiB of shared memory per CTA."""
    warp_regs = -(-max(regs, 1) // 8) * 8 * 32
    by_regs = regs_per_sm // (warp_regs * num_warps)
    by_smem = smem_per_sm // (shared + 1024) if shared else by_regs
    return max(0, min(by_regs, by_smem, max_threads // (32 * num_warps), 32))


def _ptxas_report(log: str) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from a ``ptxas -v`` log of one kernel."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if regs is None or spill is None:
        raise RuntimeError(f"unexpected ptxas -v output:\n{log}")
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def _run_ptxas(ptx: str, cc: int) -> str:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(cc).path, "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(cc)}", src, "-o", src + ".o"],
                              capture_output=True, text=True, check=True)
    return done.stderr


def compile_one(spec: Spec, arch: str, fn: Any) -> Result:
    """Compile ``spec`` of the JITFunction ``fn`` for ``arch`` (a key of ARCHS) and read its resources."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cc, regs_per_sm, smem_per_sm, _ = ARCHS[arch]
    res = Result(spec.key, arch, num_warps=spec.num_warps, expect_tensor_cores=spec.tensor_cores)
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in spec.divisible}
    src = ASTSource(fn, dict(spec.signature), constexprs=dict(spec.constexprs), attrs=attrs)
    log = io.StringIO()
    try:
        # the backend prints ptxas's -v log when asked; on a Triton cache hit there is none and ptxas runs again
        with contextlib.redirect_stdout(log), knobs.nvidia.scope():
            knobs.nvidia.dump_ptxas_log = True
            kernel = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                    options={"num_warps": spec.num_warps, "num_stages": spec.num_stages})
    except Exception as exc:  # a compile failure is a result to report, not a crash of the whole table
        res.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        return res
    ptx = kernel.asm["ptx"]
    text = log.getvalue()
    res.regs, res.spill_stores, res.spill_loads = _ptxas_report(
        text if "Used" in text else _run_ptxas(ptx, cc))
    res.shared = int(kernel.metadata.shared)
    res.tensor_cores = "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "-"
    res.ctas_per_sm = ctas_per_sm(res.regs, spec.num_warps, res.shared, regs_per_sm, smem_per_sm)
    return res


_FOUND: dict = {}


def _worker(job: tuple[Spec, str]) -> Result:
    spec, arch = job
    if not _FOUND:  # once per process
        _FOUND.update(discover())
    return compile_one(spec, arch, _FOUND["kernels"][spec.kernel])


def compile_all(archs: tuple[str, ...] = tuple(ARCHS), jobs: int | None = None,
                only: str | None = None) -> list[Result]:
    """Compile every spec for every arch (``jobs`` processes; default: the usable CPUs, at most 4). ``only``
    keeps the kernels whose name contains it."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("fastpo.kernels.aot compiles for CUDA targets: run it with TRITON_INTERPRET unset "
                           "(python -m fastpo.kernels.aot)")
    work = [(s, a) for s in specs() if only is None or only in s.kernel for a in archs if not s.archs or a in s.archs]
    jobs = jobs or min(4, len(os.sched_getaffinity(0)))
    if jobs <= 1:
        return [_worker(w) for w in work]
    import multiprocessing

    # fork: the workers inherit the imported triton and kernel modules (no CUDA context exists on this path)
    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        return pool.map(_worker, work, chunksize=1)


def table(results: list[Result]) -> str:
    """Markdown table: one row per specialisation, the archs side by side."""
    archs = list(dict.fromkeys(r.arch for r in results))
    rows: dict[str, dict[str, Result]] = {}
    for r in results:
        rows.setdefault(r.key, {})[r.arch] = r
    head = "| kernel | specialisation | warps | " + " | ".join(
        f"{a} regs | {a} spill st/ld B | {a} smem B | {a} TC | {a} CTA/SM" for a in archs) + " |"
    lines = [head, "|" + "---|" * (3 + 5 * len(archs))]
    for key, per in rows.items():
        kernel, label = key[:-1].split("[", 1)
        cells = [kernel.split(".")[-1], label, str(next(iter(per.values())).num_warps)]
        for a in archs:
            r = per.get(a)
            if r is None:  # not launched there (a TMA path on sm_80)
                cells += ["n/a"] * 5
                continue
            if r.error:
                cells += ["FAIL", r.error, "", "", ""]
                continue
            cells += [str(r.regs), f"{r.spill_stores}/{r.spill_loads}", str(r.shared), r.tensor_cores,
                      str(r.ctas_per_sm)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON lines instead of a table")
    parser.add_argument("--arch", action="append", choices=list(ARCHS), help="compile for these only")
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPUs, at most 4)")
    parser.add_argument("--only", default=None, help="kernels whose name contains this")
    args = parser.parse_args(argv)
    results = compile_all(tuple(args.arch or ARCHS), args.jobs, args.only)
    if args.json:
        for r in results:
            print(json.dumps(dataclasses.asdict(r)))
    else:
        print(table(results))
        bad = [f"{r.key} {r.arch}: {r.error or 'spills' if r.error or r.spill_stores or r.spill_loads else 'no TC'}"
               for r in results if not r.ok]
        print(f"\n{len(results)} compiles, {len(bad)} failing" + "".join(f"\n  {b}" for b in bad))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
