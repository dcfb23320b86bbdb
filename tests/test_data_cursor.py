"""The sample cursor: every sample once per epoch across batch-size changes, exact resume."""

import json

import numpy as np
import pytest

import adaptjax

N = 100
SIZES = [8, 24, 64, 16, 8, 40, 3, 1, 56]  # crosses epoch boundaries at 100, 200, ...


def _dataset(**kw):
    x = np.arange(N, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    y = np.arange(N, dtype=np.int64)
    return adaptjax.ArrayDataset(x, y, **kw)


def _stream_ids(ds, sizes):
    out = []
    for b in sizes:
        x, y = ds.next_batch(b)
        assert x.shape == (b, 3) and y.shape == (b,)
        np.testing.assert_array_equal(x[:, 0], y.astype(np.float32))  # rows stay paired
        out.append(y)
    return np.concatenate(out)


def test_every_sample_once_per_epoch_across_batch_size_changes():
    ds = _dataset(seed=3)
    ids = _stream_ids(ds, SIZES)
    total = sum(SIZES)
    assert ds.cursor == total and ds.epoch == total // N
    full = total // N
    for e in range(full):  # each complete epoch is a permutation of 0..N-1
        assert sorted(ids[e * N : (e + 1) * N].tolist()) == list(range(N))
    rest = ids[full * N :]  # the started epoch has no repeats so far
    assert len(set(rest.tolist())) == len(rest)
    # the stream is the concatenation of the documented per-epoch permutations
    expected = np.concatenate(
        [np.random.default_rng([3, e]).permutation(N) for e in range(full + 1)]
    )[:total]
    np.testing.assert_array_equal(ids, expected)


def test_batch_straddling_an_epoch_boundary_and_larger_than_an_epoch():
    ds = _dataset(seed=0)
    ds.next_batch(90)
    ids = ds.next_batch(20)[1]  # 10 from epoch 0, 10 from epoch 1
    np.testing.assert_array_equal(ids[:10], ds.permutation(0)[90:])
    np.testing.assert_array_equal(ids[10:], ds.permutation(1)[:10])
    big = ds.next_batch(250)[1]  # positions 110..359: rest of epoch 1, all of 2, part of 3
    np.testing.assert_array_equal(big[90:190], ds.permutation(2))
    assert sorted(np.concatenate([ids[10:], big[:90]]).tolist()) == list(range(N))


def test_same_stream_whatever_the_batch_sizes():
    a, b = _dataset(seed=5), _dataset(seed=5)
    ids_a = _stream_ids(a, [8] * 30)
    ids_b = _stream_ids(b, [16, 24, 64, 8, 128])
    np.testing.assert_array_equal(ids_a, ids_b)


def test_shuffle_false_is_index_order_and_epochs_differ_when_shuffled():
    ds = _dataset(shuffle=False)
    np.testing.assert_array_equal(ds.next_batch(150)[1], np.r_[np.arange(100), np.arange(50)])
    sh = _dataset(seed=0)
    assert not np.array_equal(sh.permutation(0), sh.permutation(1))
    assert not np.array_equal(_dataset(seed=1).permutation(0), sh.permutation(0))


def test_state_round_trip_through_json_continues_identically():
    ds = _dataset(seed=7)
    _stream_ids(ds, [8, 24, 64, 16])  # cursor 112, inside epoch 1
    state = json.loads(json.dumps(ds.state_dict()))
    assert state["cursor"] == 112 and state["n"] == N and state["seed"] == 7
    resumed = _dataset(seed=99)  # the saved seed wins: the saved stream continues
    resumed.load_state_dict(state)
    assert resumed.cursor == 112 and resumed.seed == 7
    np.testing.assert_array_equal(_stream_ids(resumed, [32, 8, 100]), _stream_ids(ds, [40, 100]))


def test_batch_at_is_pure():
    ds = _dataset(seed=2)
    ds.next_batch(30)
    first = ds.batch_at(95, 10)
    assert ds.cursor == 30
    for _ in range(3):
        again = ds.batch_at(95, 10)
        np.testing.assert_array_equal(again[0], first[0])
        np.testing.assert_array_equal(again[1], first[1])
    ds.next_batch(65)  # now at 95: the next batch is the one batch_at showed
    np.testing.assert_array_equal(ds.next_batch(10)[1], first[1])
    np.testing.assert_array_equal(_dataset(seed=2).batch_at(95, 10)[1], first[1])


def test_containers_dict_and_single_array():
    d = adaptjax.ArrayDataset({"img": np.zeros((6, 2, 2)), "label": np.arange(6)}, shuffle=False)
    batch = d.next_batch(4)
    assert set(batch) == {"img", "label"} and batch["img"].shape == (4, 2, 2)
    single = adaptjax.ArrayDataset(np.arange(6), shuffle=False)
    assert single.next_batch(2).tolist() == [0, 1]


def test_seek_moves_the_cursor():
    ds = _dataset(seed=1)
    ds.seek(250)
    np.testing.assert_array_equal(ds.next_batch(5)[1], ds.permutation(2)[50:55])


# -- errors --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, None])
def test_bad_batch_size(bad):
    ds = _dataset()
    with pytest.raises(ValueError, match=r"^batch_size must be a positive integer, got") as e:
        ds.next_batch(bad)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"^batch_size must be a positive integer"):
        ds.batch_at(0, bad)
    assert ds.cursor == 0


def test_bad_cursor_and_seed():
    with pytest.raises(ValueError, match=r"^cursor must be a non-negative integer, got -1$"):
        _dataset().batch_at(-1, 4)
    with pytest.raises(ValueError, match=r"^cursor must be a non-negative integer, got 1.5$"):
        _dataset().seek(1.5)
    with pytest.raises(ValueError, match=r"^seed must be a non-negative integer, got -2$"):
        _dataset(seed=-2)
    with pytest.raises(ValueError, match=r"^seed must be a non-negative integer, got None$"):
        _dataset(seed=None)


def test_loading_another_datasets_cursor():
    other = adaptjax.ArrayDataset(np.zeros((50, 3), np.float32), np.arange(50))
    ds = _dataset()
    with pytest.raises(ValueError, match=r"^this data cursor was saved for another dataset") as e:
        ds.load_state_dict(other.state_dict())
    assert "\n" not in str(e.value) and "arrays[0]=float32[50, 3]" in str(e.value)
    same_shape_other_dtype = adaptjax.ArrayDataset(
        np.zeros((N, 3), np.float64), np.arange(N, dtype=np.int64)
    )
    with pytest.raises(ValueError, match=r"saved for another dataset"):
        ds.load_state_dict(same_shape_other_dtype.state_dict())
    with pytest.raises(ValueError, match=r"^this state was saved by 'IterableDataset'"):
        ds.load_state_dict(adaptjax.IterableDataset(lambda e: range(3)).state_dict())
    with pytest.raises(ValueError, match=r"^ArrayDataset state is missing \['cursor'\]"):
        state = ds.state_dict()
        del state["cursor"]
        ds.load_state_dict(state)
    assert ds.cursor == 0


def test_an_input_codec_changes_neither_the_stream_nor_its_position():
    """Same samples in the same order, the same state_dict (a cursor saved with a codec
    resumes without one and back), and next_rows reads each process's rows of it."""
    plain = _dataset(seed=4)
    coded = _dataset(seed=4, features=adaptjax.InputCodec("int8"))
    for b in SIZES[:4]:
        x_plain, y_plain = plain.next_batch(b)
        x_coded, y_coded = coded.next_batch(b)
        np.testing.assert_array_equal(y_coded, y_plain)
        # x = sample id in [0, 99]: int8 steps of 99/255, the decode within half of one
        decoded = np.asarray(coded.decode((x_coded, y_coded))[0])
        assert np.all(np.abs(decoded - x_plain) <= 99 / 255 / 2 + 1e-5)
    assert coded.state_dict() == plain.state_dict()
    state = json.loads(json.dumps(coded.state_dict()))
    resumed_plain = _dataset(seed=0)
    resumed_plain.load_state_dict(state)
    resumed_coded = _dataset(seed=0, features=adaptjax.InputCodec("bfloat16"))
    resumed_coded.load_state_dict(plain.state_dict())
    x_plain, y_plain = resumed_plain.next_batch(30)
    x_coded, y_coded = resumed_coded.next_batch(30)
    np.testing.assert_array_equal(y_coded, y_plain)
    # x = sample id in every column, below 256: exact in bfloat16
    np.testing.assert_array_equal(np.asarray(resumed_coded.decode((x_coded, y_coded))[0]), x_plain)
    halves = []
    for start, stop in ((0, 12), (12, 24)):  # two processes, one global batch of 24
        ds = _dataset(seed=4, features=adaptjax.InputCodec("int8"))
        ds.load_state_dict(state)
        halves.append(ds.next_rows(24, start, stop))
        assert ds.cursor == coded.cursor + 24
    whole = coded.next_batch(24)
    np.testing.assert_array_equal(np.concatenate([h[0] for h in halves]), whole[0])
    np.testing.assert_array_equal(np.concatenate([h[1] for h in halves]), whole[1])


def test_mismatched_array_lengths():
    with pytest.raises(
        ValueError,
        match=r"^arrays disagree on the number of samples \{'arrays\[0\]': 5, 'arrays\[1\]': 4\}",
    ) as e:
        adaptjax.ArrayDataset(np.zeros(5), np.zeros(4))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"\{'x': 5, 'y': 6\}"):
        adaptjax.ArrayDataset({"x": np.zeros(5), "y": np.zeros(6)})


def test_empty_and_scalar_arrays():
    with pytest.raises(ValueError, match=r"^ArrayDataset needs at least one array"):
        adaptjax.ArrayDataset()
    with pytest.raises(ValueError, match=r"^ArrayDataset needs at least one sample"):
        adaptjax.ArrayDataset(np.zeros((0, 3)))
    with pytest.raises(ValueError, match=r"^arrays\[0\] is a scalar; every array needs"):
        adaptjax.ArrayDataset(np.float32(1.0))


# -- IterableDataset -----------------------------------------------------------------


def _examples(epoch):
    """A deterministic per-epoch shuffle of 10 examples (id, and a vector tied to it)."""
    for i in np.random.default_rng([11, epoch]).permutation(10):
        yield {"id": np.int64(i), "v": np.full(2, i, np.float32)}


def _batches(epoch):
    """The same stream as ``_examples``, delivered in uneven batches of 4, 4, 2."""
    order = np.random.default_rng([11, epoch]).permutation(10)
    for lo, hi in ((0, 4), (4, 8), (8, 10)):
        ids = order[lo:hi].astype(np.int64)
        yield {"id": ids, "v": np.repeat(ids[:, None], 2, 1).astype(np.float32)}


@pytest.mark.parametrize("factory,batched", [(_examples, False), (_batches, True)])
def test_iterable_counts_samples_and_crosses_epochs(factory, batched):
    ds = adaptjax.IterableDataset(factory, batched=batched)
    sizes = [3, 5, 4, 7, 1, 6]  # 26 samples: epochs 0 and 1 whole, 6 of epoch 2
    ids = []
    for b in sizes:
        batch = ds.next_batch(b)
        assert batch["id"].shape == (b,) and batch["v"].shape == (b, 2)
        np.testing.assert_array_equal(batch["v"][:, 0], batch["id"])
        ids.append(batch["id"])
    ids = np.concatenate(ids)
    assert ds.cursor == 26 and ds.epoch == 2
    for e in range(2):
        np.testing.assert_array_equal(
            ids[10 * e : 10 * (e + 1)], np.random.default_rng([11, e]).permutation(10)
        )
    np.testing.assert_array_equal(ids[20:], np.random.default_rng([11, 2]).permutation(10)[:6])


@pytest.mark.parametrize("factory,batched", [(_examples, False), (_batches, True)])
def test_iterable_resume_skips_consumed_samples(factory, batched):
    ds = adaptjax.IterableDataset(factory, batched=batched)
    for b in (4, 9):
        ds.next_batch(b)  # cursor 13: epoch 1, 3 samples in
    state = json.loads(json.dumps(ds.state_dict()))
    assert state == {
        "kind": "IterableDataset",
        "cursor": 13,
        "epoch": 1,
        "offset": 3,
        "batched": batched,
    }
    resumed = adaptjax.IterableDataset(factory, batched=batched)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # saving again before reading keeps the position
    for b in (2, 8, 5):
        np.testing.assert_array_equal(resumed.next_batch(b)["id"], ds.next_batch(b)["id"])
    assert resumed.cursor == ds.cursor == 28


def test_iterable_errors():
    with pytest.raises(ValueError, match=r"^iterable_factory must be callable"):
        adaptjax.IterableDataset([1, 2, 3])
    with pytest.raises(ValueError, match=r"^batch_size must be a positive integer, got 0$"):
        adaptjax.IterableDataset(_examples).next_batch(0)
    with pytest.raises(ValueError, match=r"^iterable_factory\(0\) yielded no samples"):
        adaptjax.IterableDataset(lambda e: []).next_batch(1)
    with pytest.raises(ValueError, match=r"^iterable_factory\(0\) did not return an iterable"):
        adaptjax.IterableDataset(lambda e: 5).next_batch(1)
    ds = adaptjax.IterableDataset(_examples)
    with pytest.raises(ValueError, match=r"^this data cursor was saved with batched=True"):
        ds.load_state_dict(adaptjax.IterableDataset(_batches, batched=True).state_dict())
    with pytest.raises(ValueError, match=r"^this state was saved by 'ArrayDataset'"):
        ds.load_state_dict(_dataset().state_dict())
    # a non-deterministic (here: shorter on re-creation) iterable is caught when it runs dry
    short = adaptjax.IterableDataset(lambda e: range(2))
    short.load_state_dict({**ds.state_dict(), "offset": 5})
    with pytest.raises(ValueError, match=r"^iterable_factory\(0\) ended after 2 samples but"):
        short.next_batch(1)
    with pytest.raises(ValueError, match=r"^every leaf of a batch from the iterable needs"):
        adaptjax.IterableDataset(lambda e: [np.float32(1)], batched=True).next_batch(1)
    with pytest.raises(ValueError, match=r"^examples from the iterable do not stack"):
        adaptjax.IterableDataset(lambda e: [np.zeros(2), np.zeros(3)]).next_batch(2)
