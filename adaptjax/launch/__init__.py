"""The ``jax.distributed`` launcher and the helpers a process uses under it (internal).

The launcher side imports no jax; the public names are
``adaptjax.initialize_distributed``, ``adaptjax.EXIT_RESCALE`` and
``adaptjax.DecisionMismatch``.
"""
