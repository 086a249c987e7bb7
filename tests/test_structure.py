"""The project's import structure, counting imports inside functions too: layers of ``kvbench`` import downward
only, no module of ``kvbench`` imports a compressor, compressors import only the layers below the cache, no import
cycle exists, and no name is used by two modules."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvbench", "compressors")

#: bottom to top: a module may import its own package and the packages of lower layers. ``kvbench`` itself (its
#: ``__init__``: the version) is below everything; its other top-level modules (the CLI, study drivers) are on top.
LAYERS = (
    ("kvbench", "kvbench.coding", "kvbench.store"),
    ("kvbench.core",),
    ("kvbench.inputs",),
    ("compressors",),
    ("kvbench.cache",),
    ("kvbench.measure",),
    ("kvbench.sweep",),
    ("kvbench.report",),
    ("kvbench.app",),  # kvbench/<module>.py: the command line and study drivers
)
#: packages compressors may import besides their own (the harness reaches them only through configs' _target_)
COMPRESSOR_DEPS = ("kvbench", "kvbench.coding", "kvbench.store", "kvbench.core", "kvbench.inputs")
TOP_LEVEL_MODULES = 10
MAX_LINES = 450


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """Project modules that ``path`` imports anywhere in its body (top level, functions, TYPE_CHECKING blocks)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            # the longest project module that the name starts with
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _layer_package(module: str) -> str:
    """The entry of :data:`LAYERS` a module belongs to."""
    if module in ("kvbench", "compressors") or module.startswith("compressors."):
        return "kvbench" if module == "kvbench" else "compressors"
    parts = module.split(".")
    if len(parts) == 2 and not (ROOT / "kvbench" / parts[1]).is_dir():
        return "kvbench.app"
    return ".".join(parts[:2])


def _layer(module: str) -> int:
    pkg = _layer_package(module)
    for i, layer in enumerate(LAYERS):
        if pkg in layer:
            return i
    raise AssertionError(f"{module}: its package {pkg} is in no layer of LAYERS; add it where it belongs")


def test_layers_import_downward_only():
    upward = []
    for m, deps in _graph().items():
        for d in deps:
            same = _layer_package(d) == _layer_package(m)
            if m.startswith("compressors"):
                ok = same or _layer_package(d) in COMPRESSOR_DEPS
            else:
                ok = same or _layer(d) < _layer(m)
            if not ok:
                upward.append(f"{m} -> {d}")
    assert not upward, "imports against the layers:\n" + "\n".join(sorted(upward))


def test_no_kvbench_module_imports_a_compressor():
    offenders = {m: sorted(d for d in deps if d.startswith("compressors"))
                 for m, deps in _graph().items() if m.startswith("kvbench")}
    assert not {m: d for m, d in offenders.items() if d}


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d] if d in stack else [m, d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not cycles, f"import cycles: {cycles}"


def test_module_names_are_unique():
    by_name: dict[str, list[str]] = {}
    for m, p in _modules().items():
        if p.name != "__init__.py":
            by_name.setdefault(p.stem, []).append(m)
    assert not {n: ms for n, ms in by_name.items() if len(ms) > 1}


def test_few_top_level_modules_and_short_modules():
    top = sorted(p.name for p in (ROOT / "kvbench").glob("*.py"))
    assert len(top) <= TOP_LEVEL_MODULES, top
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _compressor_names() -> set[str]:
    return {p.stem for p in (ROOT / "configs" / "compressor").glob("*.yaml")}


#: string constants in harness code that equal a compressor's name for another reason: summary keys of the contract
NOT_A_COMPRESSOR = {"lossless"}  # summary.json's bit-exact flag


def test_no_compressor_is_named_in_harness_or_report_code():
    """The harness and the report read what they need of a compressor from the compressor (its flags, facts and
    methods), never by its name: a new compressor needs no edit in kvbench/."""
    names = _compressor_names() - NOT_A_COMPRESSOR
    found = []
    for m, p in _modules().items():
        if not m.startswith("kvbench"):
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, "compressor names in kvbench/:\n" + "\n".join(found)


def test_each_compressor_config_is_named_as_its_class_and_declares_a_family():
    from kvbench.core.config import compressor_class

    families = {"quantizer", "transform", "predictive", "exact", "dedup", "eviction"}
    for name in sorted(_compressor_names()):
        cls = compressor_class(name)
        assert cls.name == name, f"configs/compressor/{name}.yaml selects {cls.__name__}, named {cls.name!r}"
        assert cls.family in families, f"{cls.__name__}.family={cls.family!r}; one of {sorted(families)}"


def test_each_compressor_class_declares_the_distortion_of_its_default_configuration():
    """``max_rel_mse``: a number below 1 (what a decoder returning zeros scores), 0 for a class that declares itself
    lossless; the contract suite measures every default configuration against it."""
    from kvbench.core.config import compressor_class

    for name in sorted(_compressor_names()):
        cls = compressor_class(name)
        bound = cls.max_rel_mse
        assert isinstance(bound, float) and 0 <= bound < 1, \
            f"{cls.__name__}.max_rel_mse={bound!r}; declare the relative MSE its default stays under, 0 <= x < 1"
        assert bound == 0 or not cls.lossless, f"{cls.__name__} is lossless but declares max_rel_mse={bound}"
