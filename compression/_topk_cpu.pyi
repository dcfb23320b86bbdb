"""Types of the native top-k kernel built from ``_topk_cpu.cc`` (optional: setup.py)."""

def handler() -> object:
    """The XLA FFI handler of ``adaptjax_topk_f32``, a PyCapsule."""
    ...

def scan_lanes() -> list[str]:
    """The scan lanes this CPU runs, the default first."""
    ...

def use_scan_lane(name: str, /) -> None:
    """Scan with the named lane (for tests); ``ValueError`` for a lane this CPU lacks."""
    ...
