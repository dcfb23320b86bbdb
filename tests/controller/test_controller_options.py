"""The controller's option groups (frozen dataclasses in its RunSpec) and its hooks."""

import dataclasses
import json
import os
import struct

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: adaptjax.CheckpointOptions(every=0),
         "CheckpointOptions.every must be a positive integer, got 0"),
        (lambda: adaptjax.CheckpointOptions(every=2.5),
         "CheckpointOptions.every must be a positive integer, got 2.5"),
        (lambda: adaptjax.CheckpointOptions(max_to_keep=0),
         "CheckpointOptions.max_to_keep must be an integer >= 1 or None, got 0"),
        (lambda: adaptjax.Evaluate(lambda p: {}, every=0),
         "Evaluate.every must be a positive integer, got 0"),
        (lambda: adaptjax.Evaluate(3, every=2),
         "Evaluate needs a function fn(model) -> {name: float}, got 3"),
        (lambda: adaptjax.ProgressBar(every=-1),
         "ProgressBar.every must be a positive integer, got -1"),
        (lambda: adaptjax.CompileOptions(cache_dir=3),
         "CompileOptions.cache_dir must be 'auto', a directory path or None, got 3"),
    ],
)
def test_options_refuse_bad_values_where_they_are_written(build, message):
    with pytest.raises(ValueError) as e:
        build()
    assert _one_line(e) == message


def test_options_are_frozen_and_compare_by_value():
    a = adaptjax.CheckpointOptions(every=10)
    assert a == adaptjax.CheckpointOptions(every=10, max_to_keep=3) and hash(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.every = 5
    assert adaptjax.CheckpointOptions(max_to_keep=None).max_to_keep is None


def _controller(run_dir, hooks=(), **kw):
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    spec = adaptjax.RunSpec(run_dir=run_dir, devices=2, batch_size=8,
                            compile=adaptjax.CompileOptions(cache_dir=None), **kw)
    return adaptjax.Controller(
        {"w": jnp.zeros(3)}, lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0), spec, hooks=list(hooks))


def test_a_controller_runs_by_its_spec_and_hooks(tmp_path):
    seen = []
    ctrl = _controller(
        tmp_path, checkpoint=adaptjax.CheckpointOptions(every=3, max_to_keep=5),
        hooks=[adaptjax.Evaluate(lambda p: {"w0": p["w"][0]}, every=2),
               adaptjax.Hook(lambda c: seen.append(c.step), every=4)],
    )
    ctrl.run(9)
    ctrl.close()
    assert ctrl.checkpoints.all_steps() == [3, 6, 9] and seen == [4, 8]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "eval_w0" in r] == [2, 4, 6, 8]
    assert not (tmp_path / "tensorboard").exists()  # hooks=[]: no TensorBoard


def test_default_hooks_are_a_progress_bar_and_tensorboard(tmp_path):
    assert [type(h) for h in adaptjax.default_hooks()] == [adaptjax.ProgressBar,
                                                           adaptjax.TensorBoard]
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    ctrl = adaptjax.Controller(
        {"w": jnp.zeros(3)}, lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optax.sgd(0.1), adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0),
        adaptjax.RunSpec(run_dir=tmp_path, devices=2, batch_size=8,
                         compile=adaptjax.CompileOptions(cache_dir=None)))
    ctrl.run(2)
    ctrl.close()
    assert [type(h) for h in ctrl.hooks] == [adaptjax.ProgressBar, adaptjax.TensorBoard]
    assert os.listdir(tmp_path / "tensorboard")


def test_tensorboard_writes_at_its_cadence(tmp_path):
    ctrl = _controller(tmp_path, hooks=[adaptjax.TensorBoard(every=3)])
    ctrl.run(7)
    ctrl.close()
    assert _scalar_steps(tmp_path / "tensorboard", "loss") == [3, 6]


def _scalar_steps(directory, tag: str) -> list[int]:
    """The steps of ``tag``'s scalars in ``directory``'s event files (TFRecord framing:
    length u64, its crc u32, the record, its crc u32)."""
    from tensorboardX.proto.event_pb2 import Event

    steps = []
    for name in sorted(os.listdir(directory)):
        data = (directory / name).read_bytes()
        at = 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            if any(v.tag == tag for v in event.summary.value):
                steps.append(event.step)
    return steps


@pytest.mark.parametrize("hooks, message", [
    ([print], "hooks must be adaptjax.Hook objects, got builtin_function_or_method; wrap a "
              "function as adaptjax.Hook(fn, every=N)"),
    ([adaptjax.TensorBoard(), adaptjax.TensorBoard()], "hooks hold two TensorBoards; pass one"),
])
def test_bad_hooks_are_refused_in_one_line_and_touch_nothing(tmp_path, hooks, message):
    with pytest.raises(ValueError) as e:
        _controller(tmp_path / "a", hooks=hooks)
    assert _one_line(e) == message
    assert not (tmp_path / "a").exists()


def test_bad_options_touch_nothing_on_disk(tmp_path):
    # max_to_keep used to be checked by the checkpoint manager, after run_dir was created
    with pytest.raises(ValueError, match="max_to_keep must be an integer >= 1 or None, got 0"):
        _controller(tmp_path / "b", checkpoint=adaptjax.CheckpointOptions(max_to_keep=0))
    assert not (tmp_path / "b").exists()
