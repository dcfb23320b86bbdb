"""Every public function and method is annotated (pyright checks the rest, in .ci/run).

Public: the names each public package exports (``__all__`` of ``adaptjax``,
``adaptjax.costs``, ``adaptjax.compression`` and ``adaptjax.policies``), and
the public methods and properties of the classes among them, inherited ones
from adaptjax's own base classes too. Code that Python writes (a NamedTuple's
``__new__``, a dataclass's ``__init__`` from its annotated fields) counts as
what it is generated from.
"""

import importlib
import inspect
from pathlib import Path

import pytest

PACKAGES = ("adaptjax", "adaptjax.costs", "adaptjax.compression", "adaptjax.policies")
ROOT = Path(__file__).resolve().parents[1]

# Unannotated in files other work owns now; the annotations are proposed to the lead.
# Remove an entry with its fix (the test fails on an entry that is annotated already).
PENDING: set[str] = set()  # names still to annotate (none)

PUBLIC_DUNDERS = ("__init__", "__new__", "__call__")


def _ours(obj) -> bool:
    return (getattr(obj, "__module__", None) or "").startswith("adaptjax")


def _unannotated(fn, skip_first: bool, name: str) -> list[str]:
    """The parameters (and ``->``) of ``fn`` without an annotation."""
    if not _ours(fn):  # written by Python (namedtuple, dataclass) or a third party
        return []
    params = list(inspect.signature(fn).parameters.values())[1 if skip_first else 0 :]
    missing = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    returns = inspect.signature(fn).return_annotation
    if returns is inspect.Signature.empty and name != "__init__":
        missing.append("->")
    return missing


def _methods(cls):
    """``(name, function, skip_first)`` of each public method and property of ``cls``."""
    seen = set()
    for klass in cls.__mro__:
        if not _ours(klass):
            continue
        for name, raw in vars(klass).items():
            if name in seen or (name.startswith("_") and name not in PUBLIC_DUNDERS):
                continue
            seen.add(name)
            if isinstance(raw, staticmethod):
                yield name, raw.__func__, name == "__new__"
            elif isinstance(raw, classmethod):
                yield name, raw.__func__, True
            elif isinstance(raw, property):
                if raw.fget is not None:
                    yield name, raw.fget, True
            elif inspect.isfunction(raw):
                yield name, raw, True


def _public_api():
    """``(qualified name, function, skip_first, name)`` of everything the packages export."""
    for package in PACKAGES:
        module = importlib.import_module(package)
        for export in module.__all__:
            obj = getattr(module, export)
            where = f"{package}.{export}"
            if inspect.isclass(obj):
                for name, fn, skip_first in _methods(obj):
                    yield f"{where}.{name}", fn, skip_first, name
            elif callable(obj):
                yield where, obj, False, export


def test_every_public_function_and_method_is_annotated():
    found = {}
    for where, fn, skip_first, name in _public_api():
        missing = _unannotated(fn, skip_first, name)
        if missing:
            found[where] = missing
    unexpected = {k: v for k, v in found.items() if k not in PENDING}
    assert not unexpected, f"annotate these parameters (and '->' returns): {unexpected}"
    done = sorted(PENDING - set(found))
    assert not done, f"annotated now: remove {done} from PENDING"


def test_the_walk_sees_the_whole_api():
    # the check above cannot pass by looking at nothing: it reaches methods, properties,
    # class and static methods, and the functions each package exports
    names = {where for where, *_ in _public_api()}
    assert {
        "adaptjax.data_parallel_step",
        "adaptjax.GrainDataset.from_iter_dataset",
        "adaptjax.PerReplica.tree_unflatten",
        "adaptjax.TrainState.model",
        "adaptjax.costs.Planner.config_of",
        "adaptjax.compression.Codec.sync",
        "adaptjax.compression.BlockCodec.encode",
        "adaptjax.policies.Schedule.decide",
        "adaptjax.policies.any_of",
    } <= names
    assert len(names) > 300


def test_an_unannotated_function_is_found():
    def f(x, y: int = 0):
        return x + y

    f.__module__ = "adaptjax.example"
    assert _unannotated(f, False, "f") == ["x", "->"]


def test_the_native_kernel_stub_names_what_the_kernel_defines():
    try:
        from adaptjax.compression import _topk_cpu
    except ImportError:
        pytest.skip("the native top-k kernel is not built here")
    stub = (ROOT / "compression" / "_topk_cpu.pyi").read_text()
    declared = {line.split("(")[0][4:] for line in stub.splitlines() if line.startswith("def ")}
    defined = {name for name in dir(_topk_cpu) if not name.startswith("_")}
    assert declared == defined
