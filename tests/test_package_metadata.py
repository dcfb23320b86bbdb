"""The package as installed: version, typing marker, license, lazy public names."""

import importlib
import importlib.metadata
import importlib.resources
import subprocess
import sys
from pathlib import Path

import pytest

import adaptjax

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_installed_distribution_version():
    assert adaptjax.__version__ == importlib.metadata.version("adaptjax")


def test_py_typed_ships_in_the_package():
    assert importlib.resources.files("adaptjax").joinpath("py.typed").is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text()  # package-data


def test_license_is_the_apache_2_text_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_changelog_has_a_section_for_the_current_version():
    assert f"## [{adaptjax.__version__}]" in (ROOT / "CHANGELOG.md").read_text()


FACADES = {
    "adaptjax": ROOT / "adaptjax" / "__init__.py",
    "adaptjax.costs": ROOT / "adaptjax" / "costs" / "__init__.py",
    "adaptjax.compression": ROOT / "compression" / "__init__.py",
    "adaptjax.policies": ROOT / "policies" / "__init__.py",
    "adaptjax.sync": ROOT / "adaptjax" / "sync" / "__init__.py",
}


@pytest.mark.parametrize("package", sorted(FACADES))
def test_every_public_name_resolves_to_its_module(package):
    facade = importlib.import_module(package)
    for name in facade.__all__:
        obj = getattr(facade, name)
        module = importlib.import_module(facade._NAMES[name])
        assert obj is getattr(module, name), name
    assert sorted(facade._NAMES) == sorted(facade.__all__)
    assert set(facade.__all__) <= set(dir(facade))


@pytest.mark.parametrize("package", sorted(FACADES))
def test_type_checking_imports_list_the_same_names(package):
    # what IDEs and type checkers see must match what __getattr__ serves
    import ast

    facade = importlib.import_module(package)
    tree = ast.parse(FACADES[package].read_text())
    guarded = [
        n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.dump(n.test)
    ]
    names = {
        (alias.name, node.module)
        for block in guarded
        for node in ast.walk(block)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert names == set(facade._NAMES.items())


@pytest.mark.parametrize(
    ("package", "old"), [("adaptjax", "CheckpointManager"), ("adaptjax.policies", "Planner")]
)
def test_names_renamed_in_0_2_are_gone(package, old):
    # 0.x keeps no aliases: the old name is an AttributeError, not a warning
    with pytest.raises(AttributeError, match=f"no attribute '{old}'"):
        getattr(importlib.import_module(package), old)


def test_unknown_name_raises_attribute_error_and_subpackages_still_import():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        adaptjax.nope  # noqa: B018
    from adaptjax import compression, policies

    assert compression.__name__ == "adaptjax.compression"
    assert policies.__name__ == "adaptjax.policies"


def test_star_import_gives_every_public_name():
    namespace = {}
    exec("from adaptjax import *", namespace)
    assert set(adaptjax.__all__) <= set(namespace)


def test_import_adaptjax_alone_loads_no_jax(tmp_path):
    probe = "import sys, adaptjax; adaptjax.__version__; print('jax' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, check=True,
    )
    assert result.stdout.strip() == "False"
