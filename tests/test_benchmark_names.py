"""benchmarks/compression.py must not stand in for the ``compression`` package.

Every script run from ``benchmarks/`` has that folder first on ``sys.path``, so
``import compression`` (Python 3.14's standard library, which jax, urllib3 and
fsspec try for zstd) finds the benchmark file. Imported under that name it must
hand over to the real package, or fail as a missing package does, and run none
of the benchmark.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def _run(code: str, cwd, extra_path: str | None = None) -> str:
    """Runs ``code`` the way a script in benchmarks/ runs: that folder first on sys.path.

    From ``cwd`` outside the repository, whose own ``compression/`` folder (the
    source of ``adaptjax.compression``) would otherwise be found through ``-c``'s
    current-directory entry.
    """
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if extra_path:
        env["PYTHONPATH"] = extra_path  # after sys.path[0], like the standard library
    prog = f"import sys; sys.path.insert(0, {BENCH!r})\n" + textwrap.dedent(code)
    out = subprocess.run(
        [sys.executable, "-c", prog], capture_output=True, text=True, env=env, cwd=cwd, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_compression_from_benchmarks_is_not_the_benchmark(tmp_path):
    out = _run(
        """
        try:
            import compression
        except ImportError:
            print("missing")
        else:
            print(compression.__file__)
        print("jax" in sys.modules, "adaptjax" in sys.modules)
        """,
        tmp_path,
    )
    lines = out.splitlines()
    if sys.version_info < (3, 14):
        assert lines[0] == "missing"
    else:
        assert not lines[0].startswith(BENCH), lines[0]
    assert lines[1] == "False False"  # the benchmark's own imports never ran


def test_hands_over_to_a_real_compression_package(tmp_path):
    # Stands in for Python 3.14's standard library: a package found after benchmarks/.
    pkg = tmp_path / "compression"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "zstd.py").write_text("MAGIC = 'stdlib zstd'\n")
    out = _run(
        """
        from compression import zstd
        import compression
        print(zstd.MAGIC, compression.__file__)
        """,
        tmp_path,
        extra_path=str(tmp_path),
    )
    assert out == f"stdlib zstd {pkg / '__init__.py'}"


def test_jax_imports_beside_the_benchmark(tmp_path):
    out = _run(
        """
        import jax
        from jax._src import compilation_cache
        print(getattr(compilation_cache.zstd, "__name__", None))
        """,
        tmp_path,
    )
    expected = "compression.zstd" if sys.version_info >= (3, 14) else "None"
    assert out == expected
