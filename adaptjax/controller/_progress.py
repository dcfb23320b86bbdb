"""The progress bar of a controller's run (tqdm), on process 0 only."""

from __future__ import annotations

import math
from collections.abc import Mapping

from tqdm.auto import tqdm

from adaptjax.controller._run_config import RunConfig
from adaptjax.launch._distributed import is_primary


class ProgressBar:
    """A tqdm bar from step ``initial`` to ``total``, showing the loss, batch and devices.

    Example:
      >>> from adaptjax import RunConfig
      >>> from adaptjax.controller._progress import ProgressBar
      >>> bar = ProgressBar(total=10, initial=2, show=False)
      >>> bar.update({"loss": 0.5}, RunConfig(2, 4))
      >>> bar.close()
    """

    def __init__(self, *, total: int, initial: int, show: bool):
        self.show = show
        self._bar = tqdm(total=total, initial=initial, disable=not show or not is_primary(),
                         desc="adaptjax", dynamic_ncols=True)

    def update(self, metrics: Mapping[str, float], config: RunConfig) -> None:
        """One step more; the latest metrics (when any) and the configuration in the postfix."""
        self._bar.update(1)
        if self.show and metrics:
            self._bar.set_postfix(
                loss=f"{metrics.get('loss', math.nan):.4f}", bs=config.batch_size,
                dev=config.devices, refresh=False,
            )

    def close(self) -> None:
        self._bar.close()
