"""How fastpo.engine.vllm pushes trainer weights into its in-process vLLM, and the functions it runs on vLLM's
workers for that (``LLM.collective_rpc``). Two paths, chosen by what the installed vLLM offers (docs/ENGINES.md):

- ``ipc``: vLLM's native weight-transfer API (vLLM >= 0.23, CUDA only): the LLM is built with an ``ipc`` weight
  transfer engine; a push is ``start_weight_update``, one ``update_weights`` per bucket carrying CUDA IPC handles
  of the trainer's tensors (in this process the handles resolve to the same storage: no copy), and
  ``finish_weight_update``, which runs vLLM's layer-wise reload.
- ``reload``: the model runner's in-place ``reload_weights(weights_iterator=...)`` over the bucket stream; on older
  vLLM (no such parameter), the model's own ``load_weights``.

Both run inside the worker's vLLM-config context (some layers read the current config while they load) and, on
CUDA, with the worker's device current.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import inspect
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

#: ``VLLMEngine(weight_transfer=...)``: "auto" takes ipc where :func:`ipc_unavailable_reason` finds it on CUDA.
TRANSFERS = ("auto", "ipc", "reload")
#: The worker methods the ipc path calls by name (vLLM's GPU worker defines them with the transfer engine).
IPC_WORKER_METHODS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")


def ipc_unavailable_reason(import_module: Callable[[str], Any] = importlib.import_module) -> str | None:
    """None when the installed vLLM has the native ``ipc`` weight-transfer backend and its engine arguments take a
    ``weight_transfer_config``; else why not, in one line. `import_module` is swappable for tests."""
    try:
        ipc = import_module("vllm.distributed.weight_transfer.ipc_engine")
        arg_utils = import_module("vllm.engine.arg_utils")
    except ImportError as err:
        return f"this vLLM has no weight-transfer API ({err})"
    if not hasattr(ipc, "IPCWeightTransferEngine"):
        return "this vLLM's weight-transfer module has no IPCWeightTransferEngine"
    engine_args = getattr(arg_utils, "EngineArgs", None)
    try:
        fields = {f.name for f in dataclasses.fields(engine_args)}
    except TypeError:
        return "this vLLM's EngineArgs is not a dataclass"
    if "weight_transfer_config" not in fields:
        return "this vLLM's EngineArgs has no weight_transfer_config"
    return None


#: The logger of vLLM's layer-wise in-place reload (``vllm/model_executor/model_loader/reload/layerwise.py``).
_RELOAD_LOG = "vllm.model_executor.model_loader.reload.layerwise"


class _DropWeightlessReloadWarning(logging.Filter):
    """Drops vLLM 0.32's "<Layer>: Failed to load weights" for layers without parameters (the rotary embedding):
    its layer-wise reload counts their non-persistent buffers (``cos_sin_cache``) as loadable, finds nothing loaded
    (no checkpoint has them), warns, and puts the unchanged buffer back. The warning for a layer with parameters
    (a real miss) is kept."""

    def __init__(self, weightless: set[str]):
        super().__init__()
        self.messages = {f"{name}: Failed to load weights" for name in weightless}

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in self.messages


def _worker_weightless_layers(worker: Any) -> list[str]:
    """Run on each vLLM worker: the class names of modules that hold buffers but no parameters (none of their
    instances has one), i.e. layers that no checkpoint can load."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    with_params, weightless = set(), set()
    for module in model.modules():
        name = type(module).__name__
        if next(module.parameters(recurse=False), None) is not None:
            with_params.add(name)
        elif next(module.buffers(recurse=False), None) is not None:
            weightless.add(name)
    return sorted(weightless - with_params)


def _worker_set_version(worker: Any, version: int) -> int:
    """Run on each vLLM worker (``collective_rpc``): remember the weight version its weights belong to."""
    worker._fastpo_weight_version = int(version)
    return worker._fastpo_weight_version


def _worker_get_version(worker: Any) -> int:
    return int(getattr(worker, "_fastpo_weight_version", 0))


def choose_transfer(requested: str, on_cuda: bool, ipc_reason: str | None) -> str:
    """The push path, "ipc" or "reload", for ``VLLMEngine(weight_transfer=requested)``. "auto" takes ipc on CUDA
    when vLLM has it (`ipc_reason` None), else reload; "ipc" raises ValueError where it cannot run."""
    if requested not in TRANSFERS:
        raise ValueError(f"weight_transfer must be one of {TRANSFERS}, got {requested!r}")
    if requested == "reload":
        return "reload"
    if requested == "ipc" and not on_cuda:
        raise ValueError("weight_transfer='ipc' needs CUDA (CUDA IPC handles); use 'reload' or 'auto' here")
    if requested == "ipc" and ipc_reason is not None:
        raise ValueError(f"weight_transfer='ipc' is not available: {ipc_reason}; use 'reload' or 'auto'")
    return "ipc" if on_cuda and ipc_reason is None else "reload"


@contextlib.contextmanager
def worker_context(worker: Any) -> Iterator[None]:
    """The worker's vLLM config as the current one and, on CUDA, its device as the current device: the context in
    which vLLM's own worker loads and reloads weights."""
    with contextlib.ExitStack() as stack:
        config = getattr(worker, "vllm_config", None)
        if config is not None:
            from vllm.config import set_current_vllm_config

            stack.enter_context(set_current_vllm_config(config))
        device = getattr(worker, "device", None)
        if isinstance(device, torch.device) and device.type == "cuda":
            stack.enter_context(torch.cuda.device(device))
        yield


def _model_reload(worker: Any) -> Callable[..., Any] | None:
    """The in-place reload that both the probe and the push use: the worker's model runner's ``reload_weights``."""
    return getattr(getattr(worker, "model_runner", None), "reload_weights", None)


def worker_reload_takes_iterator(worker: Any) -> bool:
    """Run on each vLLM worker: whether its model runner's in-place ``reload_weights`` accepts a
    ``weights_iterator`` (recent vLLM); older releases get the model's ``load_weights`` instead."""
    reload = _model_reload(worker)
    if reload is None:
        return False
    try:
        return "weights_iterator" in inspect.signature(reload).parameters
    except (TypeError, ValueError):  # a C-implemented or wrapped callable without a signature
        return False


def worker_reload_weights(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run on each vLLM worker: the probed ``reload_weights`` (:func:`worker_reload_takes_iterator`) over the
    (name, tensor) stream, in the worker's context."""
    with worker_context(worker):
        _model_reload(worker)(weights_iterator=weights)


def worker_load_weights(worker: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Run on each vLLM worker: the model's own ``load_weights`` over the (name, tensor) stream (older vLLM)."""
    runner = worker.model_runner
    model = runner.get_model() if hasattr(runner, "get_model") else runner.model
    with worker_context(worker):
        model.load_weights(weights=weights)


def worker_has_ipc_methods(worker: Any) -> bool:
    """Run on each vLLM worker: whether it has the weight-transfer methods the ipc path calls, and an engine behind
    them (built from the LLM's ``weight_transfer_config``)."""
    return all(callable(getattr(worker, m, None)) for m in IPC_WORKER_METHODS) and (
        getattr(worker, "weight_transfer_engine", None) is not None)


def ipc_update_info(bucket: list[tuple[str, torch.Tensor]]) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """(update_info, tensors) for one ``update_weights`` call of the ipc backend (unpacked): names, dtype names,
    shapes and one {GPU uuid: CUDA IPC handle} per tensor. The returned contiguous tensors back the handles: keep
    them until the call has returned."""
    from torch.multiprocessing.reductions import reduce_tensor

    device = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    info: dict[str, Any] = {"names": [], "dtype_names": [], "shapes": [], "ipc_handles": []}
    keep = []
    for name, tensor in bucket:
        tensor = tensor.detach().to(f"cuda:{device}").contiguous()
        keep.append(tensor)
        info["names"].append(name)
        info["dtype_names"].append(str(tensor.dtype).removeprefix("torch."))
        info["shapes"].append(list(tensor.shape))
        info["ipc_handles"].append({uuid: reduce_tensor(tensor)[1]})
    return info, keep


def push_ipc(llm: Any, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> None:
    """One weight update through vLLM's ipc backend: a bucket per ``update_weights`` call. A bucket holds whole
    decoder layers (fastpo.engine.buckets), and in this process the worker's rebuilt tensors share the storage of
    the ones sent, so each bucket's tensors can go as soon as its call returns (at most one bucket is alive)."""
    llm.collective_rpc("start_weight_update")
    try:
        for bucket in buckets:
            info, keep = ipc_update_info(bucket)
            llm.collective_rpc("update_weights", kwargs={"update_info": info})
            del keep
    except BaseException:
        # close the session where the worker still has it open (a failed gather); a failed update_weights has
        # closed it already, and finishing again would raise over the original error
        with contextlib.suppress(Exception):
            llm.collective_rpc("finish_weight_update")
        raise
    llm.collective_rpc("finish_weight_update")
    torch.cuda.ipc_collect()
