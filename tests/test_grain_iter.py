"""GrainIterDataset: a packed or filtered grain IterDataset resumes at the exact element.

The pipelines are built over ``range(N)`` repeated, so every element names the
indices it was made of: the uninterrupted stream is the reference, and a run
stopped after any number of batches, its state saved through JSON and loaded
into a new dataset over a new pipeline, must continue with exactly its
remaining batches.
"""

import json

import grain
import jax
import numpy as np
import pytest
from _controller_args import make_controller, resume_controller
from test_grain_data import controller_job

from adaptjax._grain_iter import GrainIterDataset

N = 50


def packed(prefetch=0):
    """Filtered, then packed: elements of 1..4 tokens (index i, i % 4 + 1 times), 1 in 3 dropped,
    packed first-fit into rows of 8 tokens (0 pads; a range longer than any test reads); with
    ``prefetch``, that many rows are read ahead on a thread."""
    ds = grain.MapDataset.range(10**6).map(lambda i: {"tokens": np.full(i % 4 + 1, i)})
    ds = ds.to_iter_dataset().filter(lambda e: e["tokens"][0] % 3 != 0)
    ds = grain.experimental.FirstFitPackIterDataset(ds, length_struct={"tokens": 8},
                                                    num_packing_bins=2)
    if prefetch:
        ds = grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=prefetch)
    return ds


def batches(ds, count):
    return [ds.next_batch(ds.batch_size)["tokens"] for _ in range(count)]


def test_the_packed_stream_holds_every_kept_index_once_in_order():
    # the reference itself: the filter kept exactly the indices not divisible by 3, each whole
    # (i % 4 + 1 tokens), and packing neither lost nor repeated any (the last few may still
    # wait in the two open bins)
    whole = np.concatenate(batches(GrainIterDataset(packed(), batch_size=4), 10)).ravel()
    tokens = whole[whole > 0].tolist()
    counts = {i: tokens.count(i) for i in set(tokens)}
    assert counts == {i: i % 4 + 1 for i in counts}
    assert not [i for i in counts if i % 3 == 0]
    assert {i for i in range(max(counts) - 8) if i % 3} <= set(counts)


@pytest.mark.parametrize("prefetch", [0, 6])
@pytest.mark.parametrize("stop", [0, 1, 4, 9])
def test_a_resume_continues_at_the_exact_element(stop, prefetch):
    # read ahead or not, the saved state is that of the rows handed out
    whole = batches(GrainIterDataset(packed(), batch_size=4), 12)
    first = GrainIterDataset(packed(prefetch), batch_size=4)
    head = batches(first, stop)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["cursor"] == 4 * stop
    again = GrainIterDataset(packed(prefetch), batch_size=4)
    again.load_state_dict(state)
    tail = batches(again, 12 - stop)
    for a, b in zip(whole, head + tail, strict=True):
        np.testing.assert_array_equal(a, b)


class Plain:
    """An iterator without get_state/set_state."""

    def __init__(self):
        self.i = 0

    def __iter__(self):
        return self

    def __next__(self):
        self.i += 1
        return np.int32(self.i)


class NoState(grain.IterDataset):
    """An IterDataset whose iterator cannot save its position."""

    def __iter__(self):
        return Plain()


ODD = grain.MapDataset.range(N).repeat().to_iter_dataset().filter(lambda i: i % 2)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: NoState(), "the pipeline's iterator (Plain) has no get_state(), so its "
         "position cannot be saved with a checkpoint"),
        (lambda: grain.MapDataset.range(N),
         "reads a grain.IterDataset, got a MapDataset; feed a MapDataset through "
         "adaptjax.GrainDataset"),
        (lambda: iter(ODD), "needs the grain.IterDataset itself, got its iterator"),
        (lambda: list(range(N)), "needs a grain.IterDataset, got list"),
        (lambda: ODD.batch(4), "unbatched IterDataset, this one is batched; remove .batch"),
    ],
)
def test_bad_pipelines_are_one_line_errors(make, message):
    with pytest.raises(ValueError) as err:
        GrainIterDataset(make(), batch_size=4)
    assert message in str(err.value) and "\n" not in str(err.value)


def one_line(call, message):
    with pytest.raises(ValueError) as err:
        call()
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_reads_and_states_are_one_line_errors():
    ds = GrainIterDataset(ODD, batch_size=4)
    one_line(lambda: ds.next_batch(8), "serves batches of 4 elements, asked for 8; keep each "
             "step's batch at 4 and grow the optimizer's batch in accumulated micro-steps: "
             "RunSpec(micro_batch_size=4)")
    one_line(lambda: ds.batch_at(4, 4), "reads forward only and cannot read at cursor 4")
    moved = dict(ds.state_dict(), process_count=2)
    one_line(lambda: ds.load_state_dict(moved), "saved by 2 processes and this job has 1: a "
             "packed or filtered stream has no sample index to re-split; resume on 2")
    other = GrainIterDataset(packed(), batch_size=4)
    one_line(lambda: ds.load_state_dict(other.state_dict()), "saved for another pipeline")
    short = grain.MapDataset.range(6).to_iter_dataset()
    one_line(lambda: GrainIterDataset(short, batch_size=4).batch_at(0, 8),
             "the IterDataset ended after 6 elements; make it endless")


def test_batch_at_reads_a_fresh_iterators_first_elements():
    ds = GrainIterDataset(ODD, batch_size=3)
    ds.next_batch(3)
    assert ds.batch_at(0, 5).tolist() == [1, 3, 5, 7, 9] and ds.next_batch(3).tolist() == [7, 9, 11]


class Seen(GrainIterDataset):
    """Keeps the indices of every batch the controller takes."""

    def __init__(self, pipeline, batch_size, seen):
        super().__init__(pipeline, batch_size)
        self.seen = seen

    def next_batch(self, batch_size):
        batch = super().next_batch(batch_size)
        self.seen.append(batch["idx"])
        return batch


def test_a_resumed_controller_continues_the_filtered_stream_bit_exactly(tmp_path):
    # the controller's job on a filtered pipeline (every third row dropped), stopped at step 10
    # and resumed from its checkpoint: the same elements and the same parameters
    job = controller_job()
    arrays = job.make_data()
    rows = grain.MapDataset.source([{k: v[i] for k, v in arrays.items()} for i in range(640)])
    pipeline = rows.shuffle(seed=3).repeat().to_iter_dataset().filter(lambda e: e["idx"] % 3)
    runs = {}
    for name, stops in (("whole", [16]), ("killed", [10, 16])):
        seen = []
        for i, stop in enumerate(stops):
            data = Seen(pipeline, 64, seen)
            args = job.job_kwargs(data=data, policies=[], checkpoint_every=5)
            if i:
                ctrl = resume_controller(tmp_path / name, **args)
            else:
                ctrl = make_controller(run_dir=tmp_path / name, **args)
            ctrl.run(stop)
            ctrl.close()
        runs[name] = (seen, jax.device_get(ctrl.state.params))
    whole, killed = runs["whole"][0], runs["killed"][0]
    assert len(whole) == 16 and len(killed) == 16  # 10 + the 6 steps after the checkpoint
    for a, b in zip(whole, killed, strict=True):
        np.testing.assert_array_equal(a, b)
    assert not any((b % 3 == 0).any() for b in whole)
    for a, b in zip(jax.tree.leaves(runs["whole"][1]), jax.tree.leaves(runs["killed"][1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_public_route_is_grain_dataset_from_iter_dataset():
    import adaptjax

    ds = adaptjax.GrainDataset.from_iter_dataset(ODD, batch_size=3)
    assert isinstance(ds, GrainIterDataset)
    assert ds.next_batch(3).tolist() == GrainIterDataset(ODD, batch_size=3).next_batch(3).tolist()
