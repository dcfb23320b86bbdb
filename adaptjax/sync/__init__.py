"""Synchronisation strategies (internal; the public names are ``adaptjax.*``).

The strategy protocol (:class:`adaptjax.SyncStrategy`), the five strategies
(S-SGD, model averaging, local SGD, DiLoCo, gossip) and the registry that
resolves them by name and chains them around an optimizer.
"""
