"""One way through the modules: the scheduler and the simulator load neither the model nor the
Triton kernels, and every name the engine package exports resolves to its module's object."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import pagedlab
import pagedlab.engine

HEAVY = ("pagedlab.model", "pagedlab.kernels", "pagedlab.engine.runner", "pagedlab.engine.llm",
         "triton", "transformers")


def test_importing_the_scheduler_or_the_simulator_loads_no_model_and_no_kernel():
    code = ("import sys, pagedlab.engine.scheduler, pagedlab.sim.simulator, pagedlab.sim\n"
            f"print(' '.join(m for m in sys.modules if m.startswith({HEAVY!r})))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True).stdout.split()
    assert loaded == []


def test_every_engine_export_is_its_modules_object():
    for name, module in pagedlab.engine._EXPORTS.items():
        assert getattr(pagedlab.engine, name) is getattr(
            importlib.import_module(f"pagedlab.engine.{module}"), name)
    assert set(dir(pagedlab.engine)) >= set(pagedlab.engine.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        pagedlab.engine.Nope


def test_the_fp8_dtype_has_one_home():
    """Only pagedlab.dtypes binds FP8 to a torch dtype; every other module imports it. (Any two
    bindings of torch.float8_e4m3fn are the same object, so identity cannot tell: read the
    sources.)"""
    homes = []
    for path in sorted(Path(pagedlab.__file__).parent.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            if any(isinstance(t, ast.Name) and t.id == "FP8" for t in targets):
                homes.append(path.name)
    assert homes == ["dtypes.py"]
    from pagedlab import dtypes
    from pagedlab.kernels import fp8, fp8_reference

    assert fp8_reference.FP8 is fp8.FP8 is dtypes.FP8
    assert dtypes.dtype_bytes(dtypes.FP8) == 1
