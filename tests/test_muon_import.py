"""DeepSpeed's Muon module comes in without inductor (jobs/pretrain/engine/muon_import.py), and still compiles."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from bertpipe.jobs.pretrain.engine.muon_import import compile_at_first_call, import_muon_compiling_at_first_call


def run_fresh(code: str) -> str:
    """`code` in a fresh Python, run from tests/ (its helpers importable); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_fresh_workers_engine_is_built_without_inductor_which_deepspeeds_own_zero_check_loads():
    deepspeed_alone = run_fresh("""
        import sys, torch, deepspeed
        import engine_helpers as eh
        from deepspeed.runtime.zero.utils import is_zero_supported_optimizer
        with eh.process_group():
            deepspeed.init_distributed("gloo")
            print("supported", is_zero_supported_optimizer(torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())))
        print("inductor", "torch._inductor.compile_fx" in sys.modules)
    """)
    product = run_fresh("""
        import sys
        import engine_helpers as eh
        from bertpipe.jobs.pretrain.config import PretrainConfig
        with eh.process_group():
            w = eh.worker(PretrainConfig(num_workers=1, max_steps=2))
        print("engine", type(w.engine).__name__, w.engine.zero_optimization_stage())
        print("inductor", "torch._inductor.compile_fx" in sys.modules)
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
        print("muon", MuonWithAuxAdam.__module__, MuonWithAuxAdam.__name__)
    """)
    assert deepspeed_alone.split()[-4:] == ["supported", "True", "inductor", "True"]  # what the lazy import is for
    assert "engine DeepSpeedEngine 1" in product
    assert "inductor False" in product
    assert "muon deepspeed.runtime.zero.muon.muon_optimizer MuonWithAuxAdam" in product  # DeepSpeed's own class


def test_deepspeeds_muon_kernels_are_its_own_functions_made_to_compile_at_their_first_call():
    import_muon_compiling_at_first_call()
    from deepspeed.runtime import compiler
    from deepspeed.runtime.zero.muon import original_muon

    assert compiler.compile() is torch.compile  # DeepSpeed's decorator is its own again after the import
    for kernel in (original_muon.muon_update, original_muon.zeropower_via_newtonschulz5):
        assert kernel.compiles_at_first_call
        assert kernel.__wrapped__.__module__ == original_muon.__name__


def test_a_function_compiled_at_first_call_compiles_once_and_inside_another_compile_is_traced_without_a_break():
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    lazy = compile_at_first_call(lambda x: x * 2 + 1)
    x = torch.arange(4.0)
    assert counters["stats"]["unique_graphs"] == 0  # nothing compiled at the decoration
    assert torch.equal(lazy(x), x * 2 + 1) and torch.equal(lazy(x), x * 2 + 1)
    assert counters["stats"]["unique_graphs"] == 1  # compiled at the first call, its graph reused at the second

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    outer = torch.compile(lambda x: lazy(x).sin(), backend=counting_backend)
    assert torch.equal(outer(x), (x * 2 + 1).sin())
    assert len(graphs) == 1  # one graph: the wrapper's first-call logic did not break it
