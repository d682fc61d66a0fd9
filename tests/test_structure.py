"""The package's import graph: no circles, and the forward modules reach nothing of the I/O stack.

Read with `ast` from the sources (nothing is imported), every import counted, the ones inside functions too: a
lazy import hides a circle from the interpreter, not from a reader.
"""

import ast
import os

import dflash_jax

PACKAGE = os.path.dirname(dflash_jax.__file__)
# The forward and the decode loop: pure model code. `dflash_jax.target` is the target protocol; the families'
# model modules load checkpoints too (`from_pretrained`), so the loop sees targets only through the protocol.
FORWARD = ("dflash_jax.model", "dflash_jax.drafting", "dflash_jax.attention", "dflash_jax.generate",
           "dflash_jax.target", "dflash_jax.target.moe", "dflash_jax.target.delta_rule",
           "dflash_jax.adaptive", "dflash_jax.sampling", "dflash_jax.acceptance", "dflash_jax.draft_policy",
           "dflash_jax.bookkeeping", "dflash_jax.plain", "dflash_jax._progress", "dflash_jax.step_cost_model")
# What drafters and targets share, and the targets' pure maths: they reach no I/O, no drafter config parsing (its
# layouts, decoding and checks) and no kernel module; a quantized weight brings its own product
# (`layers.QuantizedWeight`), so naming it needs no kernel either.
SHARED_MATH = ("dflash_jax.layers", "dflash_jax.rope", "dflash_jax.target.delta_rule", "dflash_jax.target.mamba2")
DRAFTER_CONFIG = ("dflash_jax.config", "dflash_jax.layouts")
KERNELS = ("dflash_jax._span_attention_mgpu", "dflash_jax.nvfp4._mosaic_gemm",
           "dflash_jax.target._expert_gemm", "dflash_jax.nvfp4", "dflash_jax.fp8")
FAMILIES = ("dflash_jax.target.dense", "dflash_jax.target.qwen3_5",  # the target families (`target.family`)
            "dflash_jax.target.nemotron_h_target")
# Model maths apart from its family's loading: no I/O, no drafter config (kernels chosen where they run)
MODEL_MATHS = ("dflash_jax.target.nemotron_h", "dflash_jax.target.mamba2", "dflash_jax.target.delta_rule")
IO = ("dflash_jax.safetensors", "dflash_jax.loader", "dflash_jax.placement", "dflash_jax.validate",
      "dflash_jax.hub", "dflash_jax.plan", "dflash_jax.nvfp4.checkpoint", "dflash_jax.nvfp4.convert",
      "dflash_jax.fp8.checkpoint")


def modules() -> dict[str, str]:
    """Module name -> source file, for every module of the package."""
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for file in files:
            if file.endswith(".py"):
                parts = os.path.relpath(os.path.join(root, file), os.path.dirname(PACKAGE))[:-3].split(os.sep)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(root, file)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports: those it names, and their parent packages (whose `__init__` runs
    first), except its own parents (already being initialised) and the root (unless named: `from . import x`)."""
    known = modules()
    graph = {}
    for name, file in known.items():
        package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
        with open(file) as f:
            tree = ast.parse(f.read(), file)
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets.add(base)
                targets |= {f"{base}.{alias.name}" for alias in node.names}  # `from . import drafting`
        edges = set()
        for target in targets:
            parts = target.split(".")
            edges |= {".".join(parts[:n]) for n in range(2, len(parts) + 1)} & known.keys()
            if target == "dflash_jax":
                edges.add(target)
        ancestors = {package.rsplit(".", n)[0] for n in range(package.count(".") + 1)}  # initialised first
        graph[name] = edges - ancestors - {name} | ({"dflash_jax"} & targets)
    return graph


def reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_the_graph_is_read():
    graph = import_graph()
    assert {"dflash_jax.plan", "dflash_jax.drafter", "dflash_jax.hub"} <= graph["dflash_jax.loader"]
    assert "dflash_jax.spec" in graph["dflash_jax.plan"]
    assert "dflash_jax.nvfp4.checkpoint" in graph["dflash_jax.plan"]
    assert "dflash_jax.drafting" in graph["dflash_jax.nnx"]  # `from . import drafting`
    assert "dflash_jax.target" in graph["dflash_jax.generate"]  # the protocol, a package's __init__


def test_no_import_circles():
    graph = import_graph()
    circles = sorted(name for name in graph if name in reach(graph, name))
    assert circles == [], f"modules on an import circle: {circles}"


def test_forward_modules_reach_no_io():
    graph = import_graph()
    for module in FORWARD:
        assert not reach(graph, module) & set(IO), f"{module} reaches {sorted(reach(graph, module) & set(IO))}"


def test_shared_and_target_maths_reach_no_io_config_or_kernel():
    """`layers`, `rope` and the recurrent mixers are pure maths over arrays: a target built on them reaches neither
    the checkpoint stack, nor the drafter config parser, nor a GPU kernel through them."""
    graph = import_graph()
    assert set(KERNELS) <= set(graph) and set(SHARED_MATH) <= set(graph)
    for module in SHARED_MATH:
        bad = reach(graph, module) & {*IO, *DRAFTER_CONFIG, *KERNELS}
        assert not bad, f"{module} reaches {sorted(bad)}"


def test_target_families_stand_on_the_template_not_on_each_other():
    """A family is one module on the shared template (`target.family`): it imports no other family, so the next
    family costs one module, not a copy."""
    graph = import_graph()
    for family in FAMILIES:
        assert not graph[family] & (set(FAMILIES) - {family}), f"{family} imports another family"
        assert "dflash_jax.target.family" in graph[family]
    for module in MODEL_MATHS:
        bad = reach(graph, module) & {*IO, *DRAFTER_CONFIG}
        assert not bad, f"{module} reaches {sorted(bad)}"


# The decode loop's modules: what a call learns is returned, or kept in a value its caller holds
# (`adaptive.Calibration`), never in a module-level container.
DECODE = ("dflash_jax.generate", "dflash_jax.plain", "dflash_jax.bookkeeping", "dflash_jax.draft_policy",
          "dflash_jax.acceptance", "dflash_jax.adaptive", "dflash_jax.sampling", "dflash_jax._progress",
          "dflash_jax.step_cost_model")
MUTABLE = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)
MUTABLE_CALLS = {"dict", "list", "set", "count", "defaultdict", "OrderedDict", "deque", "Counter"}


def test_the_decode_loop_keeps_no_module_global_registry():
    """No decode module binds a dict, list, set or counter at module level (on 03f7534 generate held four, by which
    a call's draft lengths depended on earlier calls). The one process-wide table, the progress callbacks' (a
    host callback baked into the program would recompile per callback), is `_progress.CALLBACKS`: a locked,
    bounded object of its own module, which says why."""
    known = modules()
    for module in DECODE:
        with open(known[module]) as f:
            tree = ast.parse(f.read(), known[module])
        for node in tree.body:
            if not isinstance(node, ast.Assign | ast.AnnAssign) or node.value is None:
                continue
            names = [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                     if isinstance(t, ast.Name)]
            value = node.value
            called = value.func if isinstance(value, ast.Call) else None
            name = getattr(called, "attr", None) or getattr(called, "id", None)
            assert names == ["__all__"] or not (isinstance(value, MUTABLE) or name in MUTABLE_CALLS), (
                f"{module} line {node.lineno}: {names} is module-level mutable state")
