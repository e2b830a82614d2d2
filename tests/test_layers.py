"""The layers of the product and the imports allowed between them, as one table (docs/contributing.md, "House rules",
draws the same picture). Every import counts, in any function, and so does a string naming a module
("module:function" stage references, `importlib` names): a layer that reaches one it may not import fails here, not
in a review."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "model", "jobs")

# Module prefix -> layer; a module belongs to the longest prefix that names it or a package above it.
LAYERS = {
    "bertpipe.model": "model",
    "bertpipe.pipeline": "framework",  # the package itself: its docstring only
    "bertpipe.pipeline.framework": "framework",
    "bertpipe.pipeline.formats": "formats",
    "bertpipe.pipeline.stages": "stages",
    "bertpipe.jobs": "workflow",
    "bertpipe.jobs.pretrain": "training",
    "bertpipe.jobs.tuning": "training",
    "bertpipe.jobs.glue": "training",
    "bertpipe.jobs.squad": "training",
    "bertpipe.jobs.ner": "training",
    "bertpipe.jobs.features": "training",
    # What the training jobs share with the workflow: MLflow (and the registered model's loader), config hashing,
    # cluster capacity, signals, failure causes.
    "bertpipe.jobs.services": "services",
}

# Layer -> the other layers it may import (its own modules always).
MAY_IMPORT = {
    "model": set(),
    "framework": set(),
    "formats": {"framework"},
    "stages": {"framework", "formats"},
    "services": {"framework"},
    # Training reads what the stages wrote through the formats, never the stages that wrote it.
    "training": {"framework", "formats", "model", "services"},
    "workflow": {"framework", "formats", "stages", "model", "services", "training"},
}

# Outside packages: the model is torch (numpy and safetensors for weight files); the data side never trains.
MODEL_MAY_USE = {"torch", "numpy", "safetensors"}
PIPELINE_NEVER_USES = {"torch", "deepspeed", "mlflow", "transformers"}

_MODULE_STRING = re.compile(r"bertpipe(\.\w+)+(:\w+)?")


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(("bertpipe",) + (parts[:-1] if parts[-1] == "__init__" else parts))] = path
    return out


def layer_of(module: str) -> str:
    prefixes = [p for p in LAYERS if module == p or module.startswith(p + ".")]
    assert prefixes, f"{module} belongs to no layer: add it to LAYERS"
    return LAYERS[max(prefixes, key=len)]


def imported_names(path: Path) -> tuple[set[str], set[str]]:
    """(project modules, outside top-level packages) that `path` names anywhere: imports at any depth, and string
    constants that are a project module or "module:function"."""
    project, outside = set(), set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE_STRING.fullmatch(node.value):
            names = [node.value.partition(":")[0]]
        else:
            continue
        for name in names:
            (project if name.startswith("bertpipe.") else outside).add(name if name.startswith("bertpipe.")
                                                                        else name.split(".")[0])
    return project, outside


def test_every_import_follows_the_table():
    mods = modules()
    wrong = []
    for name, path in mods.items():
        layer = layer_of(name)
        project, _ = imported_names(path)
        for target in sorted(t for t in project if t in mods):
            other = layer_of(target)
            if other != layer and other not in MAY_IMPORT[layer]:
                wrong.append(f"{name} ({layer}) imports {target} ({other})")
    assert not wrong, "imports the layer table (tests/test_layers.py MAY_IMPORT) forbids:\n" + "\n".join(wrong)


def test_the_table_has_no_circle():
    """A layer that may import one that may import it back is no layer."""
    def above(layer: str, seen: frozenset[str]) -> None:
        for lower in MAY_IMPORT[layer]:
            assert lower not in seen, f"layers in a circle: {' -> '.join([*seen, lower])}"
            above(lower, seen | {lower})

    for layer in MAY_IMPORT:
        above(layer, frozenset({layer}))
    assert set(LAYERS.values()) == set(MAY_IMPORT)


def test_the_model_uses_torch_and_the_pipeline_never_trains():
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    wrong = []
    for name, path in modules().items():
        _, outside = imported_names(path)
        if layer_of(name) == "model":
            wrong += [f"{name} uses {o}" for o in sorted(outside - stdlib - MODEL_MAY_USE)]
        if name.startswith("bertpipe.pipeline"):
            wrong += [f"{name} uses {o}" for o in sorted(outside & PIPELINE_NEVER_USES)]
    assert not wrong, wrong


def test_a_forbidden_import_is_found(tmp_path):
    """The checker itself: a formats module that imports a stage, late, inside a function, is reported."""
    bad = tmp_path / "shards.py"
    bad.write_text("def read():\n    from bertpipe.pipeline.stages import pairs\n    return pairs\n")
    project, _ = imported_names(bad)
    assert "bertpipe.pipeline.stages.pairs" in project
    assert layer_of("bertpipe.pipeline.stages.pairs") not in MAY_IMPORT[layer_of("bertpipe.pipeline.formats.shards")]


def test_the_readme_draws_the_same_table():
    """docs/contributing.md "House rules" pictures the layers as `layer -> what it may import   folders`; it says what
    MAY_IMPORT says."""
    readme = (REPO / "docs" / "contributing.md").read_text()
    rules = readme[readme.index("## House rules"):]
    drawn = {m.group(1): set() if m.group(2) == "(nothing)" else set(m.group(2).split())
             for m in re.finditer(r"^  (\w+) +-> (\(nothing\)|[\w ]+?)  ", rules, re.MULTILINE)}
    assert drawn == MAY_IMPORT
