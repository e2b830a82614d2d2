"""DeepSpeed started without the parts a pre-training run does not use. Every worker process pays DeepSpeed's
start, and a restart or a resize starts every worker anew, so what is left out here comes off each restart too.

- Its shared-memory communication op (`deepspeed_shm_comm`) is not built. The communication backend JIT-compiles
  it at start-up on a CPU machine, though only `inference_all_reduce` (tensor-parallel inference) calls it; training
  reduces through torch.distributed. The build is a C++ compile of a minute or more, once per machine and again
  whenever the environment's path changes (a new venv, a fresh clone), since the build file records the include
  paths. `deepspeed.ops.__compatible_ops__` is the one dict DeepSpeed reads to decide.
- Its autotuner's optional MLflow import is skipped: `import deepspeed` imports the autotuner, which imports MLflow
  when it can (1.0-1.5 s of one core) to log autotuning experiments, which a run never starts. A worker that logs
  to MLflow itself (rank 0) imports it anyway; the others no longer do.
- Its Muon optimizer comes in without inductor. DeepSpeed checks every ZeRO optimizer against its supported list,
  and the check imports the Muon module, whose kernels are decorated with `torch.compile` at import. A decoration
  compiles nothing yet, but it asks inductor for its configuration, and importing inductor is ~2.3 s of one core.
  Here the module is imported with each of those decorations made at the kernel's first call instead: Muon, were
  it used, compiles exactly as before, only later. (A compiled run imports inductor for its model all the same.)
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


def start_deepspeed() -> ModuleType:
    """`deepspeed`, imported (once per process) and set up as the module's docstring says."""
    deepspeed = import_without_autotuner_mlflow()
    from deepspeed import ops

    ops.__compatible_ops__["deepspeed_shm_comm"] = False
    import_muon_compiling_at_first_call()
    return deepspeed


def import_without_autotuner_mlflow() -> ModuleType:
    """`import deepspeed` with MLflow unimportable meanwhile, unless it is loaded already (then it costs nothing)."""
    if "deepspeed" in sys.modules or "mlflow" in sys.modules:
        import deepspeed

        return deepspeed
    sys.modules["mlflow"] = None  # `import mlflow` raises ImportError, which the autotuner takes as "not installed"
    try:
        import deepspeed
    finally:
        sys.modules.pop("mlflow", None)
    return deepspeed


def compile_at_first_call(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compile(fn)`, made at the first call. Inside another compiled function the plain `fn` is called, so
    dynamo traces into it, as it does into a function decorated with `torch.compile`."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if torch.compiler.is_compiling():
            return fn(*args, **kwargs)
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    call.compiles_at_first_call = True
    return call


def import_muon_compiling_at_first_call() -> None:
    """Import DeepSpeed's Muon modules (once per process) with their `compiler.compile()` decorations lazy."""
    if all(name in sys.modules for name in MUON_MODULES):
        return
    from deepspeed.runtime import compiler

    eager_decorator = compiler.compile
    compiler.compile = lambda: compile_at_first_call
    try:
        for name in MUON_MODULES:
            __import__(name)
    finally:
        compiler.compile = eager_decorator
