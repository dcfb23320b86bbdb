"""Sphinx configuration: the API reference from the docstrings, and the guide.

Build (warnings are errors, as in .ci/run):
    python -m sphinx -W --keep-going -b html docs docs/_build/html

The public packages are lazy facades (``adaptjax._lazy``): their names load on
first use through a module ``__getattr__``. Autodoc imports and reads them the
same way a user does, so what is documented is what ``import adaptjax`` gives.
"""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

from sphinx.util import logging

project = "adaptjax"
author = "the adaptjax authors"
copyright = "the adaptjax authors, Apache-2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
exclude_patterns = ["_build"]
templates_path = ["_templates"]
html_theme = "furo"
html_title = "adaptjax"
myst_heading_anchors = 3

# The packages whose ``__all__`` the reference documents, name for name.
PUBLIC_PACKAGES = (
    "adaptjax", "adaptjax.sync", "adaptjax.compression", "adaptjax.policies", "adaptjax.costs"
)

# --- API reference: one page per public name, generated from the docstrings.
# The stubs are build products: start from none, so a removed name leaves no page.
_STUBS = Path(__file__).parent / "api" / "_autosummary"
shutil.rmtree(_STUBS, ignore_errors=True)
autosummary_generate = True
autodoc_member_order = "bysource"
# Types go beside the documented arguments, so signatures stay readable.
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_custom_sections = [("Class attributes", "params_style")]

# Every cross-reference to an adaptjax name must resolve. References to other
# projects' types (annotations such as ``jax.Array``, ``optax.GradientTransformation``,
# ``collections.abc.Mapping``) cannot: the build is offline, without intersphinx.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|optax|numpy|np|flax|orbax|collections|typing|os|pathlib"
               r"|concurrent|threading|subprocess|argparse|logging|types)(\..*)?"),
    # Google-style attribute types written as dtypes or shapes ("int32: steps so far").
    (r"py:class", r"(int|uint|float|bfloat)(8|16|32|64)( array)?"),
    # Shapes in Google-style types ("float32 (3,): the last valid readings").
    (r"py:class", r"\d+"),
    # The private stand-in log of processes other than 0 (Controller.log's docstring says so).
    (r"py:class", r"NullRunLog"),
    # A catalogue's device kinds: a private record (Catalogue's docstring describes it).
    (r"py:class", r"adaptjax\.costs\._deploy\._Kind"),
    # Types from private modules (a return value's class that is not a public name,
    # such as data_parallel_step's): shown as their name, not linked.
    (r"py:.*", r"adaptjax\.(\w+\.)*_\w+(\..*)?"),
    # The same private classes where an annotation names them unqualified (they left the
    # public faces in issue 44 item 5; their docstrings say what they hold).
    (r"py:class", r"(RunLog|GrainIterDataset|GradientCodec|Plan|WireReport)"),
]

# Constants are documented by a ``#:`` comment where they are defined; their
# value is shown where it is plain (an exit code), not where its repr would
# print private module paths (a union of action classes).
_PLAIN = (bool, int, float, str)


def _constants() -> list[tuple[str, str, object]]:
    out = []
    for package in PUBLIC_PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            value = getattr(module, name)
            if not callable(value):  # an int, a tuple, a union of classes
                out.append((package, name, value))
    return out


autosummary_context = {
    "hide_value": [f"{p}.{n}" for p, n, v in _constants() if not isinstance(v, _PLAIN)],
}

# --- Docstring defects in modules the docs do not own, mended at render time
# until their source is fixed (each is in the docs' report to the source's owner).
# An entry whose text is gone from the docstring fails the build: delete it then.
DOCSTRING_FIXES: dict[str, list[tuple[str, str]]] = {
}

# Constants whose definition has no ``#:`` comment yet (same rule: delete once it has).
CONSTANT_DOCS: dict[str, str] = {}

# References in annotations or docstrings to names that are not public, shown as
# plain text until their source names a public one (same rule: delete once fixed).
PENDING_REFERENCES: dict[str, str] = {
    "adaptjax.compression._feedback.NoFeedback": "compression/_base.py: Codec.feedback's type",
}

_log = logging.getLogger(__name__)
_used: set[tuple[str, str]] = set()


def _attribute_doc(package: str, name: str, value: object) -> list[str]:
    """The ``#:`` comment of ``name`` in a module of adaptjax that binds it to ``value``."""
    from sphinx.pycode import ModuleAnalyzer

    first = importlib.import_module(package)._NAMES[name]
    modules = [first] + sorted(m for m in list(sys.modules) if m.startswith("adaptjax."))
    for modname in modules:
        if getattr(sys.modules.get(modname), name, None) is not value:
            continue
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:  # a module without source has no comments
            continue
        if ("", name) in docs:
            return list(docs[("", name)])
    return []


def _mend_docstring(app, what, name, obj, options, lines):
    for old, new in DOCSTRING_FIXES.get(name, ()):
        text = "\n".join(lines)
        if old in text:
            _used.add(("fix", name + old))
            lines[:] = text.replace(old, new).split("\n")


def _constant_doc(app, what, name, obj, options, lines):
    """A public constant's ``#:`` comment, in place of its type's docstring.

    Runs after napoleon: the comment is plain reST, not a Google-style "type: text".
    """
    package, _, short = name.rpartition(".")
    if what != "data" or package not in PUBLIC_PACKAGES:
        return
    doc = _attribute_doc(package, short, obj)
    if name in CONSTANT_DOCS:
        _used.add(("stale-constant" if doc else "constant", name))
        doc = doc or [CONSTANT_DOCS[name]]
    if not doc:
        _log.warning("%s has no #: comment where it is defined", name)
    lines[:] = [*doc, ""]


def _pending_reference(app, env, node, contnode):
    target = node.get("reftarget")
    if node.get("refdomain") == "py" and target in PENDING_REFERENCES:
        _used.add(("ref", target))
        return contnode  # plain text, no link
    return None


def _skip_member(app, what, name, obj, skip, options):
    # A NamedTuple's field properties repeat its "Attributes:" section.
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def _check_complete(app, env):
    """Every public name is documented, and every mend above is still needed."""
    objects = env.get_domain("py").objects
    for package in PUBLIC_PACKAGES:
        for name in importlib.import_module(package).__all__:
            if f"{package}.{name}" not in objects:
                _log.warning("%s.%s is public but not in docs/api/*.rst", package, name)
    for name, fixes in DOCSTRING_FIXES.items():
        for old, _ in fixes:
            if ("fix", name + old) not in _used:
                _log.warning("DOCSTRING_FIXES[%r]: %r is gone from the docstring; delete it",
                             name, old)
    for name in CONSTANT_DOCS:
        if ("stale-constant", name) in _used or ("constant", name) not in _used:
            _log.warning("CONSTANT_DOCS[%r]: the constant has its #: comment now; delete it", name)


def _check_references(app, exception):
    if exception is None:
        for target in PENDING_REFERENCES:
            if ("ref", target) not in _used:
                _log.warning("PENDING_REFERENCES[%r]: nothing refers to it any more; delete it",
                             target)


def _read_everything(app, env, added, changed, removed):
    # The checks above see only what is read and written: reread every page, every build.
    return sorted(env.found_docs - added - changed - removed)


def setup(app):
    app.connect("autodoc-process-docstring", _mend_docstring, priority=400)  # before napoleon
    app.connect("autodoc-skip-member", _skip_member)
    app.connect("missing-reference", _pending_reference)
    app.connect("autodoc-process-docstring", _constant_doc, priority=600)  # after napoleon
    app.connect("env-get-outdated", _read_everything)
    app.connect("env-check-consistency", _check_complete)
    app.connect("build-finished", _check_references)
