"""The host-side controller and its parts (internal; the public names are ``adaptjax.*``).

The loop (:class:`adaptjax.Controller`), the frozen run configuration, the
compiled-step cache keyed by it, transitions, the metrics reader, the run
directory with its lock, logs and checkpoints, the compilation cache and the
``adaptjax plan`` probe. Nothing below this package imports it.
"""
