"""The public surface a user reads: every public module (no `_` in its path) lists what it offers in `__all__`,
every listed name exists and says what it is, and the package exports only names the docs describe."""

import importlib
import inspect
import pathlib
import re

import dflash_jax

PACKAGE = pathlib.Path(dflash_jax.__file__).parent
ROOT = PACKAGE.parent


def public_modules() -> list[str]:
    """Every module whose path has no `_`-led part (`__init__` names its package; `__main__` runs the CLI)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        if parts != ("__main__",) and not any(p.startswith("_") for p in parts):
            names.append(".".join(("dflash_jax", *parts)))
    return names


def test_every_public_module_lists_what_it_offers():
    modules = public_modules()
    assert len(modules) > 40 and "dflash_jax.target.dense" in modules and "dflash_jax.nvfp4" in modules
    for name in modules:
        module = importlib.import_module(name)
        listed = getattr(module, "__all__", None)
        assert isinstance(listed, list) and listed, f"{name}: no __all__"
        assert len(set(listed)) == len(listed), f"{name}: __all__ lists a name twice"
        assert not [n for n in listed if n.startswith("_") and n != "__version__"], f"{name}: private names listed"
        assert not (missing := [n for n in listed if not hasattr(module, n)]), f"{name}: {missing} do not exist"
        undocumented = [n for n in listed if (inspect.isfunction(value := getattr(module, n)) or
                                              inspect.isclass(value)) and not inspect.getdoc(value)]
        assert not undocumented, f"{name}: {undocumented} have no docstring"


def test_the_package_exports_only_documented_names():
    """`dflash_jax.__all__` is the lazily imported exports and the version; each export is named in the README or
    docs/ (in backticks) and has a docstring."""
    exported = set(dflash_jax.__all__) - {"__version__"}
    assert exported == set(dflash_jax._EXPORTS) and "__version__" in dflash_jax.__all__
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    for name in sorted(exported):
        assert re.search(rf"`[^`\n]*\b{re.escape(name)}\b[^`\n]*`", docs), f"{name} is named nowhere in the docs"
        assert inspect.getdoc(getattr(dflash_jax, name)), f"{name} has no docstring"
