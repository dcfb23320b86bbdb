"""Checked first (issue 37 item 7): each mistake is one line, before anything is written or
compiled.

"Nothing written" is checked on disk (the run directory does not exist);
"nothing compiled" by the controller's compilation count.
"""

import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from _controller_args import make_controller  # noqa: E402

import adaptjax
from adaptjax import policies as ajp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import controller_job as job  # noqa: E402


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    return msg


def test_integer_parameters_are_refused_before_the_run_dir_exists(tmp_path):
    params = job.init_params()
    params["counts"] = jnp.arange(3)
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=tmp_path / "run", **job.job_kwargs(model=params))
    assert "parameters must be floating point, got int32 at ['counts']" in _one_line(e)
    assert not (tmp_path / "run").exists()  # no lock, no log file


def _narrow_data():
    data = job.make_data()
    data["x"] = np.ascontiguousarray(data["x"][:, :7])  # the model's w1 takes 8 features
    return data


def test_a_wrong_feature_dimension_names_the_leaf_and_both_shapes_before_the_run_dir(tmp_path):
    data = adaptjax.ArrayDataset(_narrow_data(), seed=0)
    with pytest.raises(ValueError) as e:
        make_controller(run_dir=tmp_path / "run", **job.job_kwargs(data=data))
    msg = _one_line(e)
    assert "(7,) and (8,)" in msg  # both shapes
    assert "x: float32[8, 7]" in msg  # the batch leaf, as one replica sees it (64 / 8 rows)
    assert "at controller_job.py:" in msg  # the line of loss_fn that failed (and its code)
    assert not (tmp_path / "run").exists()


def test_a_dataset_without_batch_at_is_checked_on_its_first_batch_before_compiling(tmp_path):
    rows = _narrow_data()

    def examples(epoch):
        return ({k: v[i] for k, v in rows.items()} for i in range(len(rows["x"])))

    ctrl = make_controller(
        run_dir=tmp_path / "run",
        **job.job_kwargs(data=adaptjax.IterableDataset(examples), policies=[]),
    )
    with pytest.raises(ValueError) as e:
        ctrl.run(1)
    msg = _one_line(e)
    assert "(7,) and (8,)" in msg and "x: float32[8, 7]" in msg
    assert ctrl.compilations == 0 and ctrl.step == 0


@pytest.mark.parametrize("how", ["set_hyperparams", "policy"])
def test_a_negative_learning_rate_is_refused_in_one_line_and_changes_nothing(tmp_path, how):
    bad = ajp.SetHyperparams({"learning_rate": -1})
    policies = [ajp.Schedule({2: bad})] if how == "policy" else []
    ctrl = make_controller(
        run_dir=tmp_path / "run", **job.job_kwargs(policies=policies, policy_every=1)
    )
    with pytest.raises(ValueError) as e:
        ctrl.apply([ajp.SetHyperparams(bad.values)]) if how == "set_hyperparams" else ctrl.run(5)
    assert "learning_rate must be > 0, got -1.0" in _one_line(e)
    assert ctrl.hyperparams["learning_rate"] == pytest.approx(1e-2)
    ctrl.close()
    kinds = [e["kind"] for e in ctrl.log.events]
    assert "set_hyperparams" not in kinds


# --- in files another helper owns (adaptjax/_sync.py, adaptjax/_step.py) -----------------


def _params():
    return {"w": jnp.zeros((4, 1))}


def _batch():
    x = np.ones((16, 4), np.float32)
    return {"x": x, "y": x.sum(1, keepdims=True)}


def _mse(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)


# An unbound sync axis and a loss_fn that does not match has_aux are checked by the step
# itself: tests/test_checked_first_step.py.
