"""The ``adaptjax`` command line: summary, report, plot, plan and launch (internal).

Read-only subcommands import no jax.
"""
