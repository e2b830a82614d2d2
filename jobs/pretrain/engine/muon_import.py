"""DeepSpeed's Muon module imported without loading inductor.

DeepSpeed 0.19 checks every ZeRO optimizer against its supported list, and the check imports its Muon optimizer
(`deepspeed.runtime.zero.utils.is_zero_supported_optimizer`), whose kernels are decorated with `torch.compile` at
import. A `torch.compile` decoration compiles nothing yet, but it asks inductor for its configuration, and importing
inductor is ~2.3 s of one core in every fresh worker process, a restart's included, for an optimizer the run does
not use (on the multi-node rig's two shared cores, two or three workers import it at once).

`import_muon_compiling_at_first_call` imports the same module with each of those decorations made lazy: the
function is wrapped by `torch.compile` at its first call instead of at import. DeepSpeed's Muon (were it used)
compiles exactly as before, only later.
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

MUON_MODULES = ("deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.muon.original_muon")


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
