"""A dataset wrapper that records the sample indices (``batch["idx"]``) of every batch it serves."""


class Recording:
    """Passes the controller's calls to ``ds``; keeps each served batch's ``idx`` in ``seen``."""

    def __init__(self, ds):
        self.ds = ds
        self.seen = []

    def next_batch(self, batch_size):
        batch = self.ds.next_batch(batch_size)
        self.seen.extend(batch["idx"].tolist())
        return batch

    def batch_at(self, cursor, batch_size):
        return self.ds.batch_at(cursor, batch_size)

    def state_dict(self):
        return self.ds.state_dict()

    def load_state_dict(self, state):
        self.ds.load_state_dict(state)

    @property
    def cursor(self):
        return self.ds.cursor
