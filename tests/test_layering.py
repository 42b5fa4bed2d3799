"""The package layering: every import (lazy ones too) points down this graph, and no package loops.

    cli  →  benchmarks  →  training, cluster  →  in_process  →  router, verifier_worker, drafter_worker  →  protos
         →  services

A package may import itself and any package listed for it below; nothing else of the project. `cluster/` is
the only package that imports Ray; the router reaches the tiers only through `services/` (types) and
`protos/` (the wire), never a worker module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ALLOWED: dict[str, set[str]] = {
    "services": set(),
    "protos": {"services"},
    "verifier_worker": {"protos", "services"},
    "drafter_worker": {"protos", "services"},
    "router": {"protos", "services"},
    "in_process": {"router", "verifier_worker", "drafter_worker", "protos", "services"},
    "training": {"in_process", "router", "verifier_worker", "drafter_worker", "protos", "services"},
    "cluster": {"router", "verifier_worker", "drafter_worker", "protos", "services"},
    "benchmarks": {"in_process", "training", "cluster", "router", "verifier_worker", "drafter_worker", "protos",
                   "services"},
    "cli": {"benchmarks", "in_process", "training", "cluster", "router", "verifier_worker", "drafter_worker", "protos",
            "services"},
}
RAY_PACKAGES = {"cluster", "benchmarks", "cli"}  # benchmarks and cli drive a cluster; no tier or router does
ROOT = Path(__file__).resolve().parents[1]


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, top-level module) of every import in a file, at any depth (function-level imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, ast.Import):
            out.extend((node.lineno, a.name.split(".")[0]) for a in node.names)
    return out


def violations(root: Path = ROOT) -> list[str]:
    found = []
    for package, allowed in ALLOWED.items():
        for path in sorted((root / package).rglob("*.py")):
            for line, top in imports(path):
                where = f"{path.relative_to(root)}:{line}"
                if top in ALLOWED and top != package and top not in allowed:
                    found.append(f"{where} imports {top} (above or beside {package})")
                if top == "ray" and package not in RAY_PACKAGES:
                    found.append(f"{where} imports ray (only cluster/ may)")
    return found


def test_every_import_points_down():
    assert violations() == []


def test_the_graph_has_no_cycle():
    order = []
    def visit(node, stack=()):
        assert node not in stack, f"cycle: {' → '.join((*stack, node))}"
        for dep in ALLOWED[node]:
            visit(dep, (*stack, node))
        order.append(node)
    for package in ALLOWED:
        visit(package)


def test_every_top_level_package_is_in_the_graph():
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests"}
    assert packages == set(ALLOWED)


@pytest.mark.parametrize(("package", "line", "banned"), [
    ("router", "from verifier_worker.service import Prefilled", "verifier_worker"),
    ("services", "from training.rollouts import generate", "training"),
    ("verifier_worker", "from router.session import Session", "router"),
    ("drafter_worker", "import ray", "ray"),
    ("router", "    from benchmarks.serve_bench.runner import run  # lazy", "benchmarks"),
])
def test_an_upward_import_is_caught(tmp_path, package, line, banned):
    """Each of the violations of the old layout, planted in a copy of the tree, fails the check."""
    for name in ALLOWED:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    body = f"def f():\n{line}\n" if line.startswith(" ") else line + "\n"
    (tmp_path / package / "planted.py").write_text(body)
    (found,) = violations(tmp_path)
    assert f"{package}/planted.py" in found and banned in found


def loaded_by(*modules: str, cwd: Path = ROOT) -> list[str]:
    """The project modules a fresh interpreter holds after importing `modules` (what a process loads)."""
    code = ("import sys\n" + "".join(f"import {m}\n" for m in modules) +
            f"print('\\n'.join(sorted(n for n in sys.modules if n.split('.')[0] in {sorted(ALLOWED)!r})))")
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.split()


RUNNING_DRAFTER = """
import sys
import cluster.actors
from drafter_worker.main import drafter_service
from drafter_worker.settings import DrafterSettings
drafter_service(DrafterSettings(threads=1))  # the toy target's four shipped drafters, loaded
print('\\n'.join(sorted(n for n in sys.modules if n.split('.')[0] in %r)))
"""


def test_a_drafter_replica_loads_only_the_drafter_tier():
    """What a DrafterReplica holds once it serves: its actor module, the drafter's composition root, and what
    loading the target's embeddings and its four drafters brought in. Nothing of the verifier (the actor module
    declares both replica kinds; each loads its own tier's modules); no router, HTTP or training; not the
    target's decoder (a drafter reads its embeddings only: services/embeddings.py) nor the calibration fits
    (training's)."""
    out = subprocess.run([sys.executable, "-c", RUNNING_DRAFTER % (sorted(ALLOWED),)], cwd=ROOT,
                         capture_output=True, text=True, check=True)
    loaded = out.stdout.split()
    tops = {m.split(".")[0] for m in loaded}
    assert tops == {"cluster", "drafter_worker", "protos", "services"}
    assert not {"services.model", "services.gemma", "services.calibration_metrics"} & set(loaded)
    # released formats' readers, constrained drafting, the load board and the GGUF code load when a checkpoint,
    # request, board URL or model needs them
    assert [m for m in loaded if m.startswith("drafter_worker.formats.") or m in LOADED_ON_USE] == []
    assert len(loaded) <= 58, len(loaded)  # 67 with the whole target and the fits, 64 the board, 62 the verifier's
    # settings, 60 the GGUF code


LOADED_ON_USE = ("drafter_worker.constrained", "services.grammar", "services.tokenizer",
                 "services.load_board",  # with the Redis client, only where a board is configured
                 "services.gguf", "services.pip_models")  # where a model is a GGUF file or comes by pip


COMPILER_FREE = """
import sys
import cluster.actors, router.main
from drafter_worker.main import drafter_service
from drafter_worker.settings import DrafterSettings
from services.grammar import GrammarTokenizer
from services.registry import resolve_model
from services.types import Grammar
from verifier_worker.main import verifier_service
from verifier_worker.profile import profile_sps
from verifier_worker.settings import VerifierSettings

for dtype in ("float32", "bfloat16"):  # bf16: where the CPU has AMX, its weights are packed into tiles
    service = verifier_service(VerifierSettings(dtype=dtype, threads=1))
    profile_sps(service.engine.forward, (1, 16), context=32, repeats=1)
    drafter_service(DrafterSettings(dtype=dtype, threads=1))
grammar = GrammarTokenizer(resolve_model("dspark-target"), 1024).start(Grammar("regex", "[0-9]+"))
assert grammar.allowed().any()
print(sorted(m for m in sys.modules if m.startswith(("torch._dynamo", "torch._inductor"))))
"""


def test_serving_processes_import_no_compiler_until_they_compile():
    """A router, a verifier and a drafter start (model loaded, engine built, SPS profiled, drafters loaded, a
    grammar's mask computed) without importing torch's compiler: that import cost each process 2–3 s of its
    start. Only `compile: true` needs it (services/compiled_step.py, drafter_worker/drafter.py)."""
    out = subprocess.run([sys.executable, "-c", COMPILER_FREE], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[-2] == "[]", out.stdout[-2000:]


def class_definitions(root: Path = ROOT) -> dict[str, list[str]]:
    """Class name → where it is defined, over the project's packages (generated gRPC/protobuf code aside: its
    servicer bases share their names with the servicers that implement them)."""
    found: dict[str, list[str]] = {}
    for package in ALLOWED:
        for path in sorted((root / package).rglob("*.py")):
            if "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_one_definition_per_class_name():
    """One name per idea: a class name means one thing in the whole project."""
    assert {name: where for name, where in class_definitions().items() if len(where) > 1} == {}


def wide_tier_calls(root: Path = ROOT) -> list[str]:
    """Tier calls (the methods of router/tiers/protocol.py's protocols) with more than three parameters besides
    `self`, in every class that serves or relays them: the protocols, pooling, the gRPC client, the in-process
    adapters, the tiers' services and servicers (a class that defines `prefill`, `verify` or `draft`)."""
    tree = ast.parse((root / "router/tiers/protocol.py").read_text())
    calls = {f.name for c in tree.body if isinstance(c, ast.ClassDef) for f in c.body
             if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)}
    wide = []
    for package in ALLOWED:
        for path in sorted((root / package).rglob("*.py")):
            for cls in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(cls, ast.ClassDef):
                    continue
                methods = [f for f in cls.body if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
                if not {"prefill", "verify", "draft"} & {f.name for f in methods}:
                    continue
                for f in methods:
                    a = f.args
                    width = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                    if f.name in calls and width - 1 > 3:
                        wide.append(f"{path.relative_to(root)}:{f.lineno} {cls.name}.{f.name}")
    return wide


def test_tier_calls_are_messages():
    """Calls are messages: a tier call carries one typed message (services/calls.py), never a long positional
    list, from the protocol through pooling, the gRPC client and the service to the core."""
    assert wide_tier_calls() == []


def test_a_wide_tier_call_is_caught(tmp_path):
    for name in ALLOWED:
        (tmp_path / name).mkdir()
    (tmp_path / "router/tiers").mkdir()
    (tmp_path / "router/tiers/protocol.py").write_text((ROOT / "router/tiers/protocol.py").read_text())
    (tmp_path / "services/planted.py").write_text(
        "class Adapter:\n    async def prefill(self, call):\n        ...\n\n"
        "    async def verify(self, request_id, tokens, block, budget):\n        ...\n")
    assert wide_tier_calls(tmp_path) == ["services/planted.py:5 Adapter.verify"]


def module_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Project module → the project modules it imports when it is loaded (its top-level statements, not a
    `TYPE_CHECKING` block nor a function body; a package's own `__init__` reached on the way is not counted)."""
    paths = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for package in ALLOWED for p in (root / package).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        found = set()
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                continue
            for n in ast.walk(node) if isinstance(node, ast.If | ast.Try) else [node]:
                if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                    found |= {f"{n.module}.{a.name}" if f"{n.module}.{a.name}" in paths else n.module for a in n.names}
                elif isinstance(n, ast.Import):
                    found |= {a.name for a in n.names}
        graph[name] = found & set(paths)
    return graph


def import_loops(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each loop of modules that import each other at load time, as a path (depth-first, one per loop found)."""
    loops, done, stack = [], set(), []

    def visit(node: str) -> None:
        if node in stack:
            loops.append([*stack[stack.index(node):], node])
            return
        if node in done:
            return
        stack.append(node)
        for dep in sorted(graph[node]):
            visit(dep)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    return loops


def test_no_two_modules_import_each_other_at_load_time():
    """Modules, not only packages: a loop (as `benchmarks/simulator/ahead.py` ⇄ `engine.py` was) works only in
    the order Python happens to load it."""
    assert import_loops(module_graph()) == []
    planted = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}
    assert import_loops(planted) == [["a.x", "a.y", "a.z", "a.x"]]
