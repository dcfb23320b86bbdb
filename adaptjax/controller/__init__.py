"""The host-side controller and its parts (internal; the public names are ``adaptjax.*``).

The loop (:class:`adaptjax.Controller`), its spec (:class:`adaptjax.RunSpec`) and
hooks, the compiled-step cache keyed by the run configuration (``adaptjax._run_config``,
with its transitions in ``adaptjax._transition``), the metrics reader, the run
directory with its lock, logs and checkpoints, the compilation cache and the
``adaptjax plan`` probe. Nothing below this package imports it.
"""
