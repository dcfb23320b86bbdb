"""Gradient codecs and compressed collectives (imported as ``adaptjax.compression``)."""

if __name__ != "adaptjax.compression":  # pragma: no cover - guards against shadowing
    raise ImportError("import this package as `adaptjax.compression`, not as a top-level `compression`")
