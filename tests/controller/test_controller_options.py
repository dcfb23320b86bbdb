"""The controller's options as frozen dataclasses, and the keyword arguments they group."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax
from adaptjax.controller._arguments import check_option_groups


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
        (lambda: adaptjax.EvalOptions(fn=lambda p: {}),
         "EvalOptions.fn needs EvalOptions.every (evaluate every this many steps)"),
        (lambda: adaptjax.EvalOptions(every=-1),
         "EvalOptions.every must be a positive integer, got -1"),
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


_DEFAULTS = dict(checkpoint_every=None, max_to_keep=3, eval_fn=None, eval_every=None,
                 compilation_cache_dir="auto", precompile_upcoming=True)


def _groups(**kw):
    return check_option_groups({**_DEFAULTS, **kw})


def test_keywords_and_option_objects_describe_the_same_options():
    evaluate = lambda params: {"loss": 0.0}  # noqa: E731
    by_keywords = _groups(checkpoint_every=5, max_to_keep=2, eval_fn=evaluate, eval_every=4,
                          compilation_cache_dir=None, precompile_upcoming=False)
    by_objects = _groups(
        checkpoint_options=adaptjax.CheckpointOptions(every=5, max_to_keep=2),
        eval_options=adaptjax.EvalOptions(fn=evaluate, every=4),
        compile_options=adaptjax.CompileOptions(cache_dir=None, precompile_upcoming=False),
    )
    assert by_keywords == by_objects
    assert _groups() == (adaptjax.CheckpointOptions(), adaptjax.EvalOptions(),
                         adaptjax.CompileOptions())


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(checkpoint_options=adaptjax.CheckpointOptions(every=5), checkpoint_every=5),
         "checkpoint_options and checkpoint_every= were both passed; "
         "pass CheckpointOptions(every=...) alone"),
        (dict(eval_options=adaptjax.EvalOptions(), eval_every=3),
         "eval_options and eval_every= were both passed; pass EvalOptions(every=...) alone"),
        (dict(compile_options=adaptjax.CompileOptions(), precompile_upcoming=False),
         "compile_options and precompile_upcoming= were both passed; "
         "pass CompileOptions(precompile_upcoming=...) alone"),
        (dict(checkpoint_options={"every": 5}),
         "checkpoint_options must be an adaptjax.CheckpointOptions, got dict"),
        (dict(max_to_keep=0), "max_to_keep must be an integer >= 1 or None, got 0"),
        (dict(compilation_cache_dir=3),
         "compilation_cache_dir must be 'auto', a directory path or None, got 3"),
    ],
)
def test_an_option_given_twice_or_badly_is_refused_in_one_line(kw, message):
    with pytest.raises(ValueError) as e:
        _groups(**kw)
    assert _one_line(e) == message


def _controller(run_dir, **kw):
    x = np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32)
    return adaptjax.Controller(
        model={"w": jnp.zeros(3)},
        loss_fn=lambda p, b: jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2),
        optimizer=optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        data=adaptjax.ArrayDataset({"x": x, "y": x.sum(1)}, seed=0), devices=2, batch_size=8,
        run_dir=run_dir, progress=False, tensorboard=False, compilation_cache_dir=None, **kw)


def test_a_controller_runs_by_its_option_objects(tmp_path):
    ctrl = _controller(
        tmp_path, checkpoint_options=adaptjax.CheckpointOptions(every=3, max_to_keep=5),
        eval_options=adaptjax.EvalOptions(fn=lambda p: {"w0": p["w"][0]}, every=2),
    )
    ctrl.run(6)
    ctrl.close()
    assert ctrl.checkpoints.all_steps() == [3, 6]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows if "eval_w0" in r] == [2, 4, 6]


def test_bad_options_touch_nothing_on_disk(tmp_path):
    with pytest.raises(ValueError, match="pass CheckpointOptions"):
        _controller(tmp_path / "a", checkpoint_every=2,
                    checkpoint_options=adaptjax.CheckpointOptions(every=2))
    # max_to_keep used to be checked by the checkpoint manager, after run_dir was created
    with pytest.raises(ValueError, match="max_to_keep must be an integer >= 1 or None, got 0"):
        _controller(tmp_path / "b", max_to_keep=0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
