"""Types of the native top-k kernel built from ``_topk_cpu.cc`` (optional: setup.py)."""

def handler() -> object:
    """The XLA FFI handler of ``adaptjax_topk_f32``, a PyCapsule."""
    ...
