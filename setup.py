"""Builds the optional native top-k kernel, ``adaptjax.compression._topk_cpu``.

The rest of the project's metadata is in ``pyproject.toml``. The kernel is an
XLA FFI handler compiled against jaxlib's FFI headers (``jaxlib/include``); one
build serves every Python from 3.11 on (the limited C API). It is optional: where
there is no C++17 compiler or no jaxlib at build time the install goes on
without it and ``topk``/``dgc`` select with XLA operations alone
(``adaptjax.compression.native_topk_available()`` says which).
"""

import importlib.util
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

_FLAGS = {
    "msvc": ["/O2", "/std:c++17"],
    # the kernel reads float32 bit patterns as int32: no type-based alias analysis
    "unix": ["-O3", "-std=c++17", "-fvisibility=hidden", "-fno-strict-aliasing"],
}


def _xla_ffi_include():
    """jaxlib's include folder when it holds the XLA FFI headers, else None."""
    spec = importlib.util.find_spec("jaxlib")
    if spec is None or not spec.submodule_search_locations:
        return None
    include = os.path.join(list(spec.submodule_search_locations)[0], "include")
    return include if os.path.exists(os.path.join(include, "xla", "ffi", "api", "ffi.h")) else None


class _BuildExt(build_ext):
    """Compiler flags by compiler family."""

    def build_extensions(self):
        flags = _FLAGS.get(self.compiler.compiler_type, _FLAGS["unix"])
        for ext in self.extensions:
            ext.extra_compile_args = list(flags)
        super().build_extensions()


_include = _xla_ffi_include()
_ext = []
if _include is None:
    print("adaptjax: no jaxlib FFI headers at build time; the native top-k kernel is left out")
else:
    _ext.append(
        Extension(
            "adaptjax.compression._topk_cpu",
            sources=["compression/_topk_cpu.cc"],
            include_dirs=[_include],
            define_macros=[("Py_LIMITED_API", "0x030B0000")],
            py_limited_api=True,
            language="c++",
            optional=True,  # no compiler: install without it
        )
    )

setup(
    ext_modules=_ext,
    cmdclass={"build_ext": _BuildExt},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
