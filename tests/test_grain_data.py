"""GrainDataset: a grain MapDataset's sample accounting, checked against grain's ElasticIterator.

The datasets are built over ``range(N)``, so every element names the index it
was read from: the consumed stream is known exactly, and grain's own
``ElasticIterator`` driven through the same batch, device and process changes
is the reference for its order.
"""

import importlib.util
import json
import os

import grain
import jax
import numpy as np
import pytest
from _controller_args import make_controller, resume_controller  # noqa: E402
from _recording import Recording  # noqa: E402

import adaptjax

N = 100  # not a multiple of any batch size below: batches straddle epochs
# (global batch, devices on a 1-D data mesh, processes, steps): 16 -> 32 -> 8 with 8 -> 4 -> 8
# devices, then two processes, then back to one
SCHEDULE = [(16, 8, 1, 5), (32, 4, 1, 4), (8, 8, 1, 3), (8, 8, 2, 4), (32, 8, 2, 3), (16, 8, 1, 6)]


def shuffled():
    return grain.MapDataset.range(N).shuffle(seed=7).map(lambda i: {"i": np.int32(i)})


def process_rows(batch, devices, processes, k):
    """Rows of the batch process ``k`` holds: its devices' blocks, devices in process order."""
    per_device = batch // devices
    first, last = k * devices // processes, (k + 1) * devices // processes
    return first * per_device, last * per_device


def run_adaptjax(make, schedule, prefetch=2):
    """Global batches as the controller feeds them: every change through a saved state."""
    state, batches = None, []
    for batch, devices, processes, steps in schedule:
        readers = []
        for _ in range(processes):  # each process restores the same saved cursor
            ds = adaptjax.GrainDataset(make(), process_count=processes, prefetch=prefetch)
            if state is not None:
                ds.load_state_dict(json.loads(json.dumps(state)))
            readers.append(ds)
        for _ in range(steps):
            rows = [
                ds.next_rows(batch, *process_rows(batch, devices, processes, k))["i"]
                for k, ds in enumerate(readers)
            ]
            batches.append(np.concatenate(rows))
        states = [ds.state_dict() for ds in readers]
        assert all(s == states[0] for s in states)  # every process saves the same position
        state = states[0]
        for ds in readers:
            ds.close()
    return batches, state


def run_elastic(make, schedule):
    """The same changes through grain's ElasticIterator (one per process, ShardOptions(k, K))."""
    state, batches = None, []
    for batch, _, processes, steps in schedule:
        its = []
        for k in range(processes):
            shard = grain.sharding.ShardOptions(shard_index=k, shard_count=processes)
            it = iter(grain.experimental.ElasticIterator(make().repeat(), batch, shard))
            if state is not None:
                it.set_state(state)
            its.append(it)
        for _ in range(steps):
            batches.append(np.concatenate([next(it)["i"] for it in its]))
        state = its[0].get_state()
    return batches, state


def test_every_element_once_per_epoch_in_elastic_iterators_order():
    ours, state = run_adaptjax(shuffled, SCHEDULE)
    theirs, elastic_state = run_elastic(shuffled, SCHEDULE)
    # the cursor is ElasticIterator's global_next_index: the samples of every step so far
    samples = sum(b * steps for b, *_, steps in SCHEDULE)
    assert state["cursor"] == elastic_state["global_next_index"] == samples
    assert len(ours) == len(theirs) == sum(s[3] for s in SCHEDULE)
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a, b)
    # where each row was read: a global batch is stream positions cursor .. cursor + b - 1
    positions, cursor = [], 0
    for batch, devices, processes, steps in SCHEDULE:
        layout = adaptjax.GrainDataset(shuffled(), process_count=processes, prefetch=0)
        for _ in range(steps):
            at = np.concatenate([
                layout.positions(cursor, batch, *process_rows(batch, devices, processes, k))
                for k in range(processes)
            ])
            assert sorted(at.tolist()) == list(range(cursor, cursor + batch))
            positions.append(at)
            cursor += batch
    position = np.concatenate(positions)
    value = np.concatenate(ours)
    assert cursor > 3 * N  # three whole epochs and a part
    by_position = value[np.argsort(position)]
    for e in range(cursor // N):
        assert sorted(by_position[e * N : (e + 1) * N].tolist()) == list(range(N))
    rest = by_position[(cursor // N) * N :].tolist()
    assert len(set(rest)) == len(rest)
    # and the epochs are shuffled anew: epoch 0 and epoch 1 differ
    assert by_position[:N].tolist() != by_position[N : 2 * N].tolist()


def test_random_map_and_an_unshuffled_source_follow_the_same_order():
    # a NumPy source with a per-index random transform: position p holds element p % N, and the
    # random draw is grain's (seeded per index), so ElasticIterator gives the same values
    def make():
        source = grain.MapDataset.source(np.arange(N, dtype=np.int32))
        return source.random_map(lambda i, rng: {"i": i, "r": rng.integers(1 << 30)}, seed=3)

    ours = np.concatenate(run_adaptjax(make, SCHEDULE)[0])
    theirs = np.concatenate(run_elastic(make, SCHEDULE)[0])
    np.testing.assert_array_equal(ours, theirs)
    # with one process a batch is positions cursor .. cursor + b - 1 in order
    ds = adaptjax.GrainDataset(make(), process_count=1)
    got = np.concatenate([ds.next_batch(b)["i"] for b in (16, 32, 8, 48)])
    np.testing.assert_array_equal(got, np.arange(104) % N)


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_resume_after_a_kill_at_every_step_continues_exactly(prefetch):
    sizes = [16, 16, 32, 32, 8, 8, 8, 24, 16]

    def run(ds, steps):
        return [ds.next_batch(b)["i"].tolist() for b in steps]

    whole = run(adaptjax.GrainDataset(shuffled(), prefetch=prefetch), sizes)
    for kill in range(1, len(sizes)):
        first = adaptjax.GrainDataset(shuffled(), prefetch=prefetch)
        before = run(first, sizes[:kill])
        saved = json.loads(json.dumps(first.state_dict()))  # what the checkpoint holds
        first.close()
        resumed = adaptjax.GrainDataset(shuffled(), prefetch=prefetch)
        resumed.load_state_dict(saved)
        assert saved["cursor"] == sum(sizes[:kill]) == resumed.cursor
        assert before + run(resumed, sizes[kill:]) == whole
        resumed.close()


def test_read_ahead_rows_are_dropped_when_the_rows_change():
    # the same process asked for other rows or another size gets them, never the read-ahead ones
    ds = adaptjax.GrainDataset(grain.MapDataset.range(N), process_count=2, prefetch=2)
    assert ds.next_rows(8, 0, 4).tolist() == [0, 2, 4, 6]
    assert ds.next_rows(8, 4, 8).tolist() == [9, 11, 13, 15]
    assert ds.next_batch(4).tolist() == [16, 18, 17, 19]
    assert ds.batch_at(0, 4).tolist() == [0, 2, 1, 3] and ds.cursor == 20


def test_positions_are_elastic_iterators_shards():
    ds = adaptjax.GrainDataset(grain.MapDataset.range(N), process_count=4)
    assert ds.positions(40, 8).tolist() == [40, 44, 41, 45, 42, 46, 43, 47]
    assert ds.positions(40, 8, 4, 6).tolist() == [42, 46]
    assert (ds.num_samples, ds.epoch) == (N, 0)


def controller_job():
    spec = importlib.util.spec_from_file_location(
        "controller_job", os.path.join(os.path.dirname(__file__), "controller_job.py")
    )
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    return job


def test_end_to_end_the_controller_feeds_the_same_batches_as_an_array_dataset(tmp_path):
    # an unshuffled grain source over the job's arrays is the unshuffled ArrayDataset's stream:
    # the same batches, so the same compiled steps give bit-identical parameters
    job = controller_job()
    arrays = job.make_data()
    rows = grain.MapDataset.source([{k: v[i] for k, v in arrays.items()} for i in range(640)])
    runs = {}
    for name, data in (("grain", adaptjax.GrainDataset(rows)),
                       ("array", adaptjax.ArrayDataset(arrays, shuffle=False))):
        ctrl = make_controller(
            run_dir=tmp_path / name,
            **job.job_kwargs(data=data, policies=[], checkpoint_every=None),
        )
        ctrl.run(6)
        runs[name] = (jax.device_get(ctrl.state.params), ctrl.data.cursor)
        ctrl.close()
    assert runs["grain"][1] == runs["array"][1] == 6 * 64
    for a, b in zip(jax.tree.leaves(runs["grain"][0]), jax.tree.leaves(runs["array"][0]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


RANGE = grain.MapDataset.range


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: RANGE(N).batch(8), "unbatched MapDataset, this one is batched; remove .batch"),
        (lambda: RANGE(N).to_iter_dataset(),
         "got an IterDataset's PrefetchIterDataset; build the pipeline from "
         "grain.MapDataset.source"),
        (lambda: iter(RANGE(N).to_iter_dataset()), "got an IterDataset's"),
        (lambda: RANGE(N)[1::2],
         "already sharded (SliceMapDataset[1:100:2]); pass the unsharded dataset"),
        (lambda: RANGE(N).slice(slice(0, None, 4)).map(lambda i: {"i": i}),
         "already sharded (SliceMapDataset[0:100:4]); pass the unsharded dataset"),
        (lambda: RANGE(N).batch(8).map(lambda b: b + 1), "this one is batched; remove .batch"),
        (lambda: RANGE(N).filter(lambda i: i % 2), "through .filter(...)"),
        (lambda: RANGE(0), "the MapDataset is empty"),
        (lambda: list(range(N)),
         "needs a grain.MapDataset, got list; wrap a sequence as grain.MapDataset.source"),
    ],
)
def test_bad_pipelines_are_one_line_errors(make, message):
    with pytest.raises(ValueError) as err:
        adaptjax.GrainDataset(make())
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_reads_and_states_are_one_line_errors():
    ds = adaptjax.GrainDataset(grain.MapDataset.range(N), process_count=2)
    with pytest.raises(ValueError, match="batch_size 9 does not split over 2 processes; use a"):
        ds.next_batch(9)
    with pytest.raises(ValueError, match=r"rows \[4, 12\) are not inside a batch of 8"):
        ds.next_rows(8, 4, 12)
    with pytest.raises(ValueError, match="prefetch must be a non-negative integer"):
        adaptjax.GrainDataset(grain.MapDataset.range(N), prefetch=-1)
    other = adaptjax.GrainDataset(grain.MapDataset.range(N).map(lambda i: i))
    with pytest.raises(ValueError, match="saved for another pipeline .* load it into the pipeline"):
        ds.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="saved by 'ArrayDataset', not 'GrainDataset'"):
        ds.load_state_dict(adaptjax.ArrayDataset(np.arange(N)).state_dict())
    ragged = adaptjax.GrainDataset(RANGE(N).map(lambda i: np.zeros(i % 2 + 1)))
    with pytest.raises(ValueError, match="positions 0..1 do not stack into a batch") as err:
        ragged.next_batch(2)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("element", ["one feature too many", "keys the loss does not read"])
def test_elements_the_loss_cannot_take_are_refused_before_anything_compiles(tmp_path, element):
    # the controller's shape check reads the first batch (batch_at) before compiling
    job = controller_job()
    arrays = job.make_data()
    if element == "one feature too many":
        def make(i):
            return {"x": np.append(arrays["x"][i], 0.0).astype(np.float32), "y": arrays["y"][i]}
    else:
        def make(i):
            return {"features": arrays["x"][i], "label": arrays["y"][i]}
    wide = grain.MapDataset.source(np.arange(640)).map(make)
    with pytest.raises(ValueError, match="loss_fn cannot run on this data's batches") as err:
        make_controller(run_dir=tmp_path, **job.job_kwargs(data=adaptjax.GrainDataset(wide)))
    assert "\n" not in str(err.value) and not (tmp_path / "checkpoints").exists()
    if element != "one feature too many":
        assert "features: float32[" in str(err.value)
        assert "the batch has no key 'x'; make the data's shapes match" in str(err.value)


def test_the_controller_reads_the_grain_stream_in_order_through_batch_and_mesh_changes(tmp_path):
    # the job's schedule (batch 64 -> 32, 8 -> 4 devices, batch 96, back to 8 devices) with a
    # checkpoint every 10 steps: the controller consumes stream positions 0, 1, 2, ... in order
    job = controller_job()
    arrays = job.make_data()
    rows = grain.MapDataset.source([{k: v[i] for k, v in arrays.items()} for i in range(640)])
    pipeline = rows.shuffle(seed=3)
    data = Recording(adaptjax.GrainDataset(pipeline))
    ctrl = make_controller(run_dir=tmp_path, **job.job_kwargs(data=data))
    ctrl.run(50)
    seen = np.asarray(data.seen)
    assert len(seen) == ctrl.samples_seen == data.ds.cursor > 4 * 640
    stream = pipeline.repeat()
    assert seen.tolist() == [int(stream[p]["idx"]) for p in range(len(seen))]
    for e in range(len(seen) // 640):
        assert sorted(seen[e * 640 : (e + 1) * 640].tolist()) == list(range(640))
    rescales = [e for e in ctrl.log.events if e["kind"] == "rescale"]
    assert [(e["devices_from"], e["devices_to"]) for e in rescales] == [(8, 4), (4, 8)]
    sizes = {e["config"]["batch_size"] for e in ctrl.log.events if e["kind"] == "compile"}
    assert {64, 32, 96} <= sizes
    ctrl.close()


def test_a_resumed_controller_continues_the_grain_stream_where_its_checkpoint_left_it(tmp_path):
    job = controller_job()
    arrays = job.make_data()
    rows = grain.MapDataset.source([{k: v[i] for k, v in arrays.items()} for i in range(640)])
    pipeline = rows.shuffle(seed=3)
    kwargs = dict(policies=[], checkpoint_every=5)
    runs = {}
    for name, stops in (("whole", [16]), ("killed", [10, 16])):
        for i, stop in enumerate(stops):
            data = Recording(adaptjax.GrainDataset(pipeline))
            args = job.job_kwargs(data=data, **kwargs)
            if i:  # stopped at step 10: a new controller and dataset resume from its checkpoint
                ctrl = resume_controller(tmp_path / name, **args)
            else:
                ctrl = make_controller(run_dir=tmp_path / name, **args)
            ctrl.run(stop)
            ctrl.close()
        runs[name] = (data.seen, jax.device_get(ctrl.state.params))
    stream = pipeline.repeat()
    assert runs["killed"][0] == [int(stream[p]["idx"]) for p in range(10 * 64, 16 * 64)]
    assert runs["whole"][0][10 * 64 :] == runs["killed"][0]
    for a, b in zip(jax.tree.leaves(runs["whole"][1]), jax.tree.leaves(runs["killed"][1]),
                    strict=True):
        np.testing.assert_array_equal(a, b)
