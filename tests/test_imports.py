"""The package's import graph has no cycle: each module of python/osp imports only modules below it.

Module-level imports only (``import x``/``from x import y`` at the top level or under ``if``/``try``);
an import inside a function runs when it is called, not when the module loads, and is the one way to
reach upwards (e.g. ``osp.__getattr__`` importing ``osp.elastic``)."""
import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python")


def _module_imports(path: str, module: str, lazy: bool = False) -> set:
    """What ``module`` imports at load time; ``lazy``: inside its functions too."""
    tree = ast.parse(open(path).read())
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)) and not lazy:
                continue
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name.startswith("osp"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("osp"):
                    continue
                out.add(target)
                for a in node.names:  # ``from . import ops``: a submodule
                    out.add(f"{target}.{a.name}")
            else:
                visit([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])
    visit(tree.body)
    return out


def _graph(lazy: bool = False) -> dict:
    mods = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "osp")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                mods[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return {m: {t for t in _module_imports(p, m, lazy) if t in mods and t != m} for m, p in mods.items()}


def _cycle(graph: dict):
    state, stack = {}, []

    def dfs(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                found = dfs(t)
                if found:
                    return found
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state:
            found = dfs(m)
            if found:
                return found
    return None


def test_import_graph_has_no_cycle():
    graph = {m: {t for t in ts if not (m.startswith(t + ".") or t == "osp")} for m, ts in _graph().items()}
    # a package's __init__ importing its submodules is not a cycle (they import siblings, not the package)
    assert len(graph) > 20, sorted(graph)
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_no_cycle_through_imports_inside_functions_either():
    """A function-level import that closes a cycle (broadcast.py importing optimizer.py, whose join() imported
    broadcast.py) is a cycle all the same: the two modules are one piece. (The package's lazy attributes,
    ``osp.__getattr__``, import by name through importlib.)"""
    graph = {m: {t for t in ts if not (m.startswith(t + ".") or t == "osp")}
             for m, ts in _graph(lazy=True).items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_tool_is_loaded_by_import_osp():
    """A module run as ``python -m osp.X`` (one with a ``__main__`` block: osp.plan, osp.profile, osp.train, ...)
    is not among what ``import osp`` loads: runpy would find it in sys.modules before running it and warn
    ("'osp.plan' found in sys.modules after import of package 'osp'") on every call. A layer below the tools
    takes what it needs from a module below them (osp.linkemu's rate parser is osp.units', not osp.plan's)."""
    graph = _graph()
    loaded, todo = set(), ["osp"]
    while todo:
        m = todo.pop()
        if m not in loaded:
            loaded.add(m)
            todo += sorted(graph[m])
    tools = {m for m in graph if m != "osp" and "__main__" in open(_path(m)).read()}
    assert {"osp.plan", "osp.profile", "osp.train"} <= tools, tools
    assert not loaded & tools, f"import osp loads the tools {sorted(loaded & tools)}"


def _path(module: str) -> str:
    base = os.path.join(ROOT, *module.split("."))
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


COMMUNICATION = ("osp.comm", "osp.linkemu", "osp.broadcast", "osp.units", "osp.teardown")
ABOVE = ("osp.modes", "osp.optimizer", "osp.plan", "osp.profile", "osp.train", "osp.stepmodel", "osp.policy",
         "osp.split", "osp.meter")


def test_the_communication_layer_reaches_nothing_above_it():
    """The communication layer (collectives, the emulated link, broadcasts, units) loads no mode, optimizer or
    tool, directly or through what it imports: a broadcast does not ask a mode whether it may run (HSP marks its
    extras as the rank's own with ``osp.comm.alone()``), the link does not parse its rates with the planner's
    code (``osp.units``)."""
    graph = _graph()
    bad = {}
    for m in COMMUNICATION:
        seen, todo = set(), [m]
        while todo:
            x = todo.pop()
            if x not in seen and x != "osp":  # the package's facade (``from . import x`` names it): not a layer
                seen.add(x)
                todo += sorted(graph[x])
        up = sorted(x for x in seen if x.startswith(ABOVE))
        if up:
            bad[m] = up
    assert not bad, bad


MAX_CLASS_LINES = 350


def test_no_class_over_350_lines():
    """One job a class: none of python/osp over ``MAX_CLASS_LINES`` lines (OSPMode was 444: its stage 2 is
    ``Deferral`` now; policy.py's three jobs are three modules)."""
    big = {}
    for dirpath, _, files in os.walk(os.path.join(ROOT, "osp")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                        big[f"{os.path.relpath(path, ROOT)}:{node.name}"] = node.end_lineno - node.lineno + 1
    assert not big, big
