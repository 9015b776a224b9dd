"""The docs and the layout stay true to the code: docs/design.md's module map is the one the
package's docstrings generate (every module listed), its step path the one a traced step
enters (in at most 10 files), every name README.md and docs/design.md give in backticks
exists, no module imports one that imports it, and no file, class or function of the package
outgrows what a reader takes in at once."""

from __future__ import annotations

import ast
import functools
import importlib
import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fsdp_compose"


def module_map():
    spec = importlib.util.spec_from_file_location("module_map", ROOT / "docs" / "module_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_design_module_map_is_generated_from_the_package():
    tool = module_map()
    assert tool.documented() == tool.module_map(), "run: python docs/module_map.py --write"
    listed = tool.documented()
    for path in PACKAGE.rglob("*.py"):
        if path.parent != PACKAGE and path.name != "__init__.py":
            assert f"  {path.name} " in listed, f"{path.relative_to(ROOT)} is not in the map"
    folders = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert sorted(tool.ORDER) == folders


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the trace names functions by "
                    "code.co_qualname (Python 3.11); the newest Python's CI leg checks it")
def test_design_step_path_is_the_traced_step_and_stays_within_ten_files():
    # A process of its own: the trace initialises a (fake) process group.
    run = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "step_path.py"), "--check"],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr + "\nrun: python docs/step_path.py --write"
    head = re.search(r"(\d+) functions in (\d+) files", (ROOT / "docs" / "design.md").read_text())
    assert head is not None and int(head.group(2)) <= 10, head and head.group(0)


def _imports(path: pathlib.Path) -> set[str]:
    """The package's modules that `path` imports, `TYPE_CHECKING` blocks included."""
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            found.update({target, *(f"{target}.{alias.name}" for alias in node.names)})
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fsdp_compose"):
            found.add(node.module)
    return found


def test_no_module_imports_one_that_imports_it():
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p
        for p in PACKAGE.rglob("*.py") if p.name != "__init__.py"
    }
    graph = {name: _imports(path) & modules.keys() for name, path in modules.items()}

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name == goal:
                return True
            if name not in seen:
                seen.add(name)
                todo.extend(graph[name])
        return False

    circles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if reaches(b, a))
    assert not circles, circles


def test_no_file_class_or_function_outgrows_a_read():
    too_long = []
    for path in PACKAGE.rglob("*.py"):
        source = path.read_text()
        if source.count("\n") > 300:
            too_long.append(f"{path.name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            limit = 300 if isinstance(node, ast.ClassDef) else 60
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    too_long.append(f"{path.name}: {node.name} {length} lines")
    assert not too_long


# Every name the docs give in backticks exists: a file, one of our definitions or attributes,
# or torch's. A name that no longer exists (renamed, removed) fails here, naming the doc.

DOCS = [ROOT / "README.md", ROOT / "docs" / "design.md"]
SOURCES = [PACKAGE, ROOT / "benchmarks", ROOT / "tests", ROOT / "examples",
           ROOT / "docs" / "module_map.py"]
# Backticked words that are prose, not names: values as a user writes them.
PROSE = {"4MiB", "4MB", "4M"}  # the planner's budgets
# Where a name that is not ours is looked up, its first part first: Python's builtins and
# torch's namespaces and classes.
TORCH_NAMESPACES = [
    "builtins", "torch", "torch.Tensor", "torch.nn", "torch.nn.Module", "torch.autograd",
    "torch.distributed", "torch.distributed.tensor", "torch.distributed.tensor.DTensor",
    "torch.distributed.tensor.placement_types", "torch.distributed.device_mesh.DeviceMesh",
    "torch.distributed.ProcessGroup", "torch.distributed.fsdp", "torch.optim.Optimizer",
    "torch.distributed.checkpoint", "torch.testing._internal.common_distributed",
]
ALIASES = {"dist": "torch.distributed", "nn": "torch.nn"}


def resolve(dotted: str):
    """The object a dotted name of torch's (or Python's) names, or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part, None)
            if obj is None:
                return None
        return obj
    return None


class Index:
    """Every name our sources define or reach: definitions, assignments, arguments, keywords,
    imports and attributes; each class's members; each module's top-level names; every
    string constant (flags, environment variables, file names)."""

    def __init__(self):
        self.names, self.strings = set(), set()
        self.members, self.bases, self.modules = {}, {}, {}
        for source in SOURCES:
            for path in [source] if source.is_file() else sorted(source.rglob("*.py")):
                self.read(path)

    def read(self, path):
        tree = ast.parse(path.read_text())
        if path.is_relative_to(PACKAGE):
            module = path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")
            module = module.removesuffix("__init__").rstrip(".")
            self.modules[module] = {
                n.id if isinstance(n, ast.Name) else n.name if hasattr(n, "name") else n.asname
                for node in tree.body for n in self.defined(node)}
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.names.add(node.name)
            elif isinstance(node, ast.Name):
                self.names.add(node.id)
            elif isinstance(node, ast.Attribute):
                self.names.add(node.attr)
            elif isinstance(node, ast.arg):
                self.names.add(node.arg)
            elif isinstance(node, ast.keyword) and node.arg:
                self.names.add(node.arg)
            elif isinstance(node, ast.alias):
                self.names.update(node.name.split(".") + [node.asname or ""])
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                self.strings.add(node.value)
            if isinstance(node, ast.ClassDef):
                members = self.members.setdefault(node.name, set())
                self.bases.setdefault(node.name, set()).update(
                    ast.unparse(base).split(".")[-1] for base in node.bases)
                for child in node.body:
                    members.update(self.name_of(n) for n in self.defined(child))
                for child in ast.walk(node):
                    if (isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Store)
                            and isinstance(child.value, ast.Name) and child.value.id == "self"):
                        members.add(child.attr)

    @staticmethod
    def defined(node):
        """What a top-level or class-level statement defines."""
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return [node]
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            return node.names
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        return [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]

    @staticmethod
    def name_of(node):
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.alias):
            return node.asname or node.name
        return node.name

    def class_has(self, cls, member, seen=()):
        if member in self.members[cls]:
            return True
        ours = [b for b in self.bases[cls] if b in self.members and b not in seen]
        if any(self.class_has(b, member, (*seen, cls)) for b in ours):
            return True
        # A member inherited from torch's base (nn.Module, Protocol, Enum, ...).
        external = [b for b in self.bases[cls] if b not in self.members]
        return any(hasattr(resolve(f"{ns}.{b}"), member)
                   for b in external for ns in TORCH_NAMESPACES + ["typing", "enum"])

    def exists(self, dotted):
        """Whether a dotted name is ours, torch's or Python's."""
        parts = dotted.removeprefix("fsdp_compose.").split(".")
        if parts[0] in ALIASES:
            parts = ALIASES[parts[0]].split(".") + parts[1:]
        if parts[0] == "torch":
            # Torch's, or a private attribute of torch's objects that we reach.
            return resolve(".".join(parts)) is not None or (
                len(parts) > 2 and resolve(".".join(parts[:-1])) is not None
                and parts[-1] in self.names)
        for cut in range(len(parts) - 1, 0, -1):  # module.path.name
            module = ".".join(parts[:cut])
            if module in self.modules:
                return parts[cut] in self.modules[module] and (
                    cut + 1 == len(parts) or self.exists(".".join(parts[cut:])))
        if parts[0] in self.members:  # Class.member
            return len(parts) == 1 or (
                self.class_has(parts[0], parts[1]) and all(p in self.names for p in parts[2:]))
        if torch_objects := self.torch_objects(parts[0]):
            # DeviceMesh._flatten: torch's, or an attribute of torch's object that we reach.
            return all(p in self.names for p in parts[1:]) or any(
                resolve_attrs(o, parts[1:]) is not None for o in torch_objects)
        if len(parts) == 1:
            return self.is_attribute(dotted) or resolve(dotted) is not None  # or a module
        # A placeholder's method (`model.parameters()`, `trace.table()`): the method exists.
        # A placeholder is a variable's name; `_layout.flat_shards` names no module of ours.
        return re.fullmatch(r"[a-z][a-z0-9_]*", parts[0]) is not None and all(
            self.is_attribute(p) for p in parts[1:])

    def is_attribute(self, name):
        """Whether a name is ours, or an attribute of one of torch's namespaces or classes."""
        return name in self.names or bool(self.torch_objects(name))

    @staticmethod
    def torch_objects(name):
        return [o for ns in TORCH_NAMESPACES if (o := resolve(f"{ns}.{name}")) is not None]

    def keyword_exists(self, keyword, function):
        """A keyword argument of ours, or of a function of torch's (not checked further)."""
        root = function.split(".")[0]
        return keyword in self.names or (
            (root in (*ALIASES, "torch") or bool(self.torch_objects(function)))
            and root not in self.members
        )


def resolve_attrs(obj, parts):
    for part in parts:
        obj = getattr(obj, part, None)
    return obj


def code_spans(text):
    """The inline code spans of a markdown text (outside fenced blocks), on one line each."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", prose)]


NAME = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
PATH = re.compile(r"^\.?[\w.-]*(/[\w.-]*)*\.(py|md|toml|txt|json|png)$|^[\w.-]+/([\w.-]+/?)*$")


def names_in(span, index):
    """Whether the names a code span gives exist: a dotted name, the functions it calls and
    their keywords. Arguments are placeholders (`torch.chunk(param, W)`): not checked."""
    if span.startswith(".") and re.fullmatch(NAME, span[1:]):  # `.grad`
        return index.is_attribute(span[1:])
    try:
        tree = ast.parse(span.removesuffix(":"), mode="eval")
    except SyntaxError:  # `fsdp_post_all_gather(..., out=)`, `reshard_after_forward=<int>`
        calls = re.findall(rf"({NAME})\s*\(", span)
        keywords = re.findall(r"(\w+)=(?!=)", span)
        return bool(calls or keywords) and all(index.exists(n) for n in calls + keywords)
    if re.fullmatch(NAME, span):
        return index.exists(span)
    checked = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            checked = True
            function = ast.unparse(node.func)
            if re.fullmatch(NAME, function):
                if not index.exists(function):
                    return False
            elif not (isinstance(node.func, ast.Attribute)  # `f(x).to_local()`
                      and index.is_attribute(node.func.attr)):
                return False
            if not all(index.keyword_exists(k.arg, function) for k in node.keywords if k.arg):
                return False
    return checked


def unknown_names(index, text, folder=ROOT):
    """What the markdown `text` (in `folder`) names that does not exist."""
    unknown = []
    for span in code_spans(text):
        if span in PROSE:
            continue
        try:
            ast.literal_eval(span)  # a value: `None`, `1e-3`, `("dp_replicate", "tp")`
            continue
        except (ValueError, SyntaxError):
            pass
        if ">=" in span:  # a version range: pyproject.toml's
            if span not in (ROOT / "pyproject.toml").read_text():
                unknown.append(span)
        elif re.fullmatch(r"\((\w+, )+\w+\)", span):  # a tuple of words: `(dp, tp)`
            continue
        elif PATH.match(span):
            if not ((ROOT / span).exists() or (PACKAGE / span).exists()):
                unknown.append(span)
        elif span.startswith("-"):  # a flag of one of our scripts
            if span.split()[0] not in index.strings:
                unknown.append(span)
        elif span.split()[0] in ("python", "torchrun", "pip"):  # a command
            unknown += command_unknowns(index, span)
        elif not names_in(span, index) and span not in index.strings:
            unknown.append(span)  # (a string of ours: an attribute set by name, a backend)
    for match in re.finditer(r"\]\(([^)#:]+)\)", text):  # links to files of the repository
        if not (folder / match.group(1)).exists():
            unknown.append(match.group(1))
    for block in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        unknown += command_unknowns(index, block)
    return unknown


def command_unknowns(index, commands):
    """The scripts of ours and `-m fsdp_compose...` modules that `commands` run and that do
    not exist."""
    run = re.findall(r"[\w.-]+/[\w./-]+\.py\b", commands)
    scripts = [w for w in run if not (ROOT / w).exists()]
    modules = [m for m in re.findall(r"-m (fsdp_compose\S*)", commands)
               if m.removeprefix("fsdp_compose.") not in index.modules]
    return scripts + modules


@functools.cache
def source_index():
    return Index()


def test_every_name_in_the_docs_exists():
    index = source_index()
    unknown = {doc.name: unknown_names(index, doc.read_text(), doc.parent) for doc in DOCS}
    assert not any(unknown.values()), f"names that do not exist: {unknown}"


def test_the_name_check_catches_a_made_up_name():
    index = source_index()
    for made_up in ["`Gatherer.lay_out`", "`Reducer._combine_replicas`", "`_layout.flat_shards`",
                    "`comm/_streams.py`", "`frobnicate_shards`", "`torch.utils.pytree`",
                    "`DeviceMesh._no_such_thing`", "`--no-such-flag`", "`frobnicate(x, y=1)`",
                    "`python -m fsdp_compose.nowhere`"]:
        assert unknown_names(index, f"A sentence with {made_up}."), made_up
