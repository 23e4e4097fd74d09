"""The package's layers (ARCHITECTURE.md): no module imports from a layer above its own, and the map names every
module there is and no path that is not."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "paged"

SETTINGS = {"paged.validation", "paged.geometry", "paged.sampling_params", "paged.config"}
FEATURES = {
    "paged.speculative",
    "paged.offload",
    "paged.kv_connector",
    "paged.disagg",
    "paged.lora",
    "paged.beam_search",
}
# the features sit beside the engine: the engine step calls them, and they run on its parts
LAYERS = ["settings", "core", "model", "engine", "serving", "analysis", "viz"]
# what a layer may import besides its own and the ones below it: the scheduler asks the KV connector
EXCEPTIONS = {"core": {"paged.kv_connector"}}
# below in the list, yet not needed: the forward pass and its kernels know nothing of the scheduler's bookkeeping
NOT_BELOW = {"model": {"core"}}


def layer_of(module: str) -> str | None:
    if module in SETTINGS:
        return "settings"
    if module in FEATURES:
        return "engine"
    if module.startswith("paged.kernels"):
        return "model"
    parts = module.split(".")
    if len(parts) > 2 and parts[1] in {"core", "model", "engine", "serving", "analysis", "viz"}:
        return parts[1]
    return None  # paged, paged.__main__ and the subpackages' own __init__ files: the top, or empty


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def is_module(name: str) -> bool:
    path = ROOT / name.replace(".", "/")
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path) -> set[str]:
    """Every paged module the file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paged"):
            submodules = {
                f"{node.module}.{alias.name}" for alias in node.names if is_module(f"{node.module}.{alias.name}")
            }
            found |= submodules if len(submodules) == len(node.names) else submodules | {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("paged")}
    return found


MODULES = sorted(PACKAGE.rglob("*.py"))


def allowed(importer: str, imported: str) -> bool:
    mine, theirs = layer_of(importer), layer_of(imported)
    if mine is None or theirs is None:
        return mine is None or imported in {"paged.kernels", "paged.model", "paged.viz"}
    if theirs == mine or imported in EXCEPTIONS.get(mine, set()):
        return True
    return LAYERS.index(theirs) < LAYERS.index(mine) and theirs not in NOT_BELOW.get(mine, set())


@pytest.mark.parametrize("path", MODULES, ids=lambda path: module_name(path))
def test_no_module_imports_from_a_layer_above_its_own(path):
    importer = module_name(path)
    upward = sorted(imported for imported in imports(path) if not allowed(importer, imported))
    assert not upward, f"{importer} ({layer_of(importer)}) imports {upward}"


def test_the_engine_never_imports_the_chapters_calculators():
    for path in MODULES:
        if layer_of(module_name(path)) in {"core", "model", "engine", "serving"}:
            assert not {m for m in imports(path) if m.startswith(("paged.analysis", "paged.viz"))}, module_name(path)


MAP = (ROOT / "ARCHITECTURE.md").read_text()


def test_every_path_the_map_names_exists():
    named = set(re.findall(r"`((?:paged|tests)/[\w/]*(?:\.py)?)`", MAP))
    named |= {
        f"paged/{path}"
        for path in re.findall(
            r"`((?:core|model|engine|serving|analysis|kernels|viz)/[\w/]*"
            r"(?:\.py)?)`",
            MAP,
        )
    }
    assert len(named) > 40
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, missing


def test_the_map_places_every_module():
    def placed(path: Path) -> bool:
        relative = path.relative_to(PACKAGE).as_posix()
        return f"`paged/{relative}`" in MAP or f"`{relative}`" in MAP or f"`{path.name}`" in MAP

    modules = [path for path in MODULES if path.name != "__init__.py" and path.parent.name not in {"viz", "kernels"}]
    assert len(modules) > 40
    assert not [path.relative_to(PACKAGE).as_posix() for path in modules if not placed(path)]
