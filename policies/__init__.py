"""Adaptation policies: pure decisions over a dict of metrics (imported as ``adaptjax.policies``)."""

if __name__ != "adaptjax.policies":  # pragma: no cover - guards against shadowing
    raise ImportError("import this package as `adaptjax.policies`, not as a top-level `policies`")
