"""Synchronisation strategies (the strategies' public names are ``adaptjax.*``).

The strategy protocol (:class:`adaptjax.SyncStrategy`), the five strategies
(S-SGD, model averaging, local SGD, DiLoCo, gossip) and the registry that
resolves them by name and chains them around an optimizer.

Public here: the heterogeneous data split (:func:`dirichlet_split`,
:class:`SplitArrayDataset`).
"""

from adaptjax.sync._split import SplitArrayDataset, dirichlet_split

__all__ = ["SplitArrayDataset", "dirichlet_split"]
