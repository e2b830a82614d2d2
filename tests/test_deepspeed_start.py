"""DeepSpeed started without what a run does not use (jobs/pretrain/engine/deepspeed_start.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from bertpipe.jobs.pretrain.engine.deepspeed_start import compile_at_first_call, import_muon_compiling_at_first_call


def run_fresh(code: str, env: dict[str, str] | None = None) -> str:
    """`code` in a fresh Python, run from tests/ (its helpers importable); its stdout."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_fresh_workers_engine_starts_deepspeed_without_its_unused_op_build_mlflow_import_and_inductor(tmp_path):
    deepspeed_alone = run_fresh("""
        import sys, torch
        import deepspeed
        print("mlflow", "mlflow" in sys.modules)
        import engine_helpers as eh
        from deepspeed.runtime.zero.utils import is_zero_supported_optimizer
        with eh.process_group():
            deepspeed.init_distributed("gloo")
            print("supported", is_zero_supported_optimizer(torch.optim.AdamW(torch.nn.Linear(4, 4).parameters())))
        print("inductor", "torch._inductor.compile_fx" in sys.modules)
    """)
    # an empty torch extensions folder: a new machine, where DeepSpeed would build its shared-memory op
    product = run_fresh("""
        import sys
        import engine_helpers as eh
        from bertpipe.jobs.pretrain.config import PretrainConfig
        with eh.process_group():
            w = eh.worker(PretrainConfig(num_workers=1, max_steps=2))
        import deepspeed.comm.comm as c
        print("engine", type(w.engine).__name__, w.engine.zero_optimization_stage())
        print("shm op", c.cdb.shm_comm_op)
        print("inductor", "torch._inductor.compile_fx" in sys.modules)
        print("mlflow", "mlflow" in sys.modules)
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
        print("muon", MuonWithAuxAdam.__module__, MuonWithAuxAdam.__name__)
        import mlflow  # importable as ever once DeepSpeed is in: rank 0's run logger needs it
        print("mlflow then", mlflow.MlflowClient.__name__)
    """, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    # what is left out, DeepSpeed left to itself loads: MLflow at import, inductor at its ZeRO optimizer check
    assert {"mlflow True", "supported True", "inductor True"} <= set(deepspeed_alone.splitlines())
    assert "engine DeepSpeedEngine 1" in product
    assert "shm op None" in product
    assert not (tmp_path / "ext").exists() or not any((tmp_path / "ext").rglob("*")), "an op was built"
    assert "inductor False" in product and "mlflow False" in product
    assert "muon deepspeed.runtime.zero.muon.muon_optimizer MuonWithAuxAdam" in product  # DeepSpeed's own class
    assert "mlflow then MlflowClient" in product


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

    graphs_before = counters["stats"]["unique_graphs"]  # (other tests of this process may have compiled)
    lazy = compile_at_first_call(lambda x: x * 2 + 1)
    x = torch.arange(4.0)
    assert counters["stats"]["unique_graphs"] == graphs_before  # nothing compiled at the decoration
    assert torch.equal(lazy(x), x * 2 + 1) and torch.equal(lazy(x), x * 2 + 1)
    assert counters["stats"]["unique_graphs"] == graphs_before + 1  # compiled at the first call, reused after

    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    outer = torch.compile(lambda x: lazy(x).sin(), backend=counting_backend)
    assert torch.equal(outer(x), (x * 2 + 1).sin())
    assert len(graphs) == 1  # one graph: the wrapper's first-call logic did not break it
