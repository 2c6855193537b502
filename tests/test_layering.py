"""The package's layers import only downwards.

    0 base: errors, config, units, timing, host_pages
    1 formats/ (on-disk layouts)
    2 loading/ (checkpoints, loaders, tokenizer)
    3 models/, kvcache/, kernels/
    4 runtime/, engine/, placement/
    5 llm (the facade), server/, cli, bench/

Every ``import`` statement is read with ``ast``, including those inside functions and under
``if TYPE_CHECKING``, so an upward import cannot hide in a function body.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "src" / "hybridllm"
PACKAGE = "hybridllm"

BASE_MODULES = ("hybridllm.errors", "hybridllm.config", "hybridllm.units", "hybridllm.timing", "hybridllm.host_pages")
LOWER_PACKAGES = ("loading", "models", "kvcache", "formats", "kernels")
UPPER_MODULES = ("hybridllm.engine", "hybridllm.runtime", "hybridllm.llm", "hybridllm.server", "hybridllm.cli",
                 "hybridllm.bench", "hybridllm.placement")


def module_name(path: Path) -> str:
    """``src/hybridllm/loading/loader.py`` -> ``hybridllm.loading.loader`` (packages: their ``__init__``'s name)."""
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` imports, anywhere in the file, as absolute dotted names.

    ``from a.b import c`` yields both ``a.b`` and ``a.b.c`` (``c`` may be a submodule).
    """
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: climb from this module's package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if alias.name != "*")
    return {name for name in found if name == PACKAGE or name.startswith(PACKAGE + ".")}


def package_modules() -> dict[str, set[str]]:
    """Module name -> the hybridllm modules it imports, for every module of the package."""
    out = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        name = module_name(path)
        out[name] = imported_modules(path.read_text(), name, is_package=path.name == "__init__.py")
    return out


def within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def violations(modules: dict[str, set[str]], importers: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    """``importer -> imported`` for each import of a ``forbidden`` module (or the bare package facade)."""
    return sorted(f"{name} -> {target}" for name, targets in modules.items() if within(name, importers)
                  for target in targets if target == PACKAGE or within(target, forbidden))


@pytest.fixture(scope="module")
def modules() -> dict[str, set[str]]:
    found = package_modules()
    # the scan must see the modules it judges, or every assertion below passes vacuously
    assert {"hybridllm.loading.loader", "hybridllm.models.quantized", "hybridllm.formats.gguf_blocks",
            "hybridllm.units", "hybridllm.timing", "hybridllm.config"} <= found.keys()
    assert "hybridllm.timing" in found["hybridllm.loading.loader"]
    return found


def test_the_scan_sees_imports_inside_functions_and_relative_imports():
    source = "import os\n\ndef f():\n    from hybridllm.engine.metrics import RequestTimer\n    from . import gguf\n"
    found = imported_modules(source, "hybridllm.loading.loader")
    assert found == {"hybridllm.engine.metrics", "hybridllm.engine.metrics.RequestTimer", "hybridllm.loading",
                     "hybridllm.loading.gguf"}
    assert violations({"hybridllm.loading.loader": found}, ("hybridllm.loading",), UPPER_MODULES) == [
        "hybridllm.loading.loader -> hybridllm.engine.metrics",
        "hybridllm.loading.loader -> hybridllm.engine.metrics.RequestTimer",
    ]


def test_lower_layers_do_not_import_the_engine_the_facade_or_the_tools(modules):
    lower = tuple(f"{PACKAGE}.{p}" for p in LOWER_PACKAGES)
    assert violations(modules, lower, UPPER_MODULES) == []


def test_formats_do_not_import_loading(modules):
    assert violations(modules, ("hybridllm.formats",), ("hybridllm.loading",)) == []


def test_models_and_kv_caches_do_not_import_loading(modules):
    # the loaders build models, never the reverse: a model's block formats come from formats/
    assert violations(modules, ("hybridllm.models", "hybridllm.kvcache"), ("hybridllm.loading",)) == []


def test_base_modules_import_only_base_modules(modules):
    for name in BASE_MODULES:
        above = sorted(t for t in modules[name] if not within(t, BASE_MODULES))
        assert above == [], f"{name} imports {above}"


FACADE_USERS = ("hybridllm.cli", "hybridllm.server", "hybridllm.bench")
TOOLS = ("hybridllm.llm", "hybridllm.server", "hybridllm.cli", "hybridllm.bench", "hybridllm.planner",
         "hybridllm.doctor", "hybridllm.eval")


def test_only_the_front_ends_import_the_facade(modules):
    importers = sorted(name for name, targets in modules.items()
                       if "hybridllm.llm" in targets and not within(name, FACADE_USERS))
    assert importers == ["hybridllm"]  # the package re-exports LLM; nothing else below the front ends uses it


def test_runtime_and_engine_do_not_import_the_front_ends_or_the_tools(modules):
    assert violations(modules, ("hybridllm.runtime", "hybridllm.engine", "hybridllm.placement"), TOOLS) == []


def test_placement_is_below_the_runtime_and_the_runtime_below_the_engine(modules):
    # Placement data and its application are what the runtime is built from; the request loop
    # runs a built runtime, and the runtime never reaches up into the loop.
    assert violations(modules, ("hybridllm.placement",), ("hybridllm.runtime", "hybridllm.engine")) == []
    assert violations(modules, ("hybridllm.runtime",), ("hybridllm.engine",)) == []


def test_the_scheduler_is_bookkeeping_without_torch():
    """The step is plan -> execute -> process: the scheduler plans in plain Python; the executor
    and the output processor hold the tensors."""
    tree = ast.parse((PACKAGE_ROOT / "engine" / "scheduler.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name == "torch" or name.startswith("torch.") for name in imported)


def test_every_engine_and_runtime_module_is_in_the_layer_diagram(modules):
    """docs/architecture.md's layer diagram names every module of engine/ and runtime/ (by file name)."""
    text = (PACKAGE_ROOT.parents[1] / "docs" / "architecture.md").read_text()
    start = text.index("## Layers and the build path")
    diagram = text[text.index("```", start):text.index("```", text.index("```", start) + 3)]
    files = [path for package in ("engine", "runtime") for path in sorted((PACKAGE_ROOT / package).glob("*.py"))
             if path.name != "__init__.py"]
    assert len(files) > 20 and all(module_name(path) in modules for path in files)
    assert [path.name for path in files if path.name not in diagram] == []
