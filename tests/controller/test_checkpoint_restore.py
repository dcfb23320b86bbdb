"""Orbax checkpoints: save on one mesh, restore onto another, and refuse what doesn't fit."""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import adaptjax


class EFState(NamedTuple):
    residual: adaptjax.PerReplica


def error_feedback_like():
    """Keeps a per-replica residual that grows by (replica index + 1) x the local gradient.

    It passes the updates through unchanged, so the trajectory of the params does not
    depend on the residual: restoring onto another mesh must continue the same trajectory.
    """

    def init(params):
        return EFState(adaptjax.PerReplica(jax.tree.map(jnp.zeros_like, params)))

    def update(updates, state, params=None, **extra):
        scale = jax.lax.axis_index("data").astype(jnp.float32) + 1.0
        residual = jax.tree.map(lambda r, u: r + scale * u, state.residual.value, updates)
        return updates, EFState(adaptjax.PerReplica(residual))

    return optax.GradientTransformationExtraArgs(init, update)


TX = optax.chain(error_feedback_like(), adaptjax.sync_gradients("data"), optax.adam(0.05))


def params_like(w_shape=(4, 3), dtype=jnp.float32):
    return {"w": jnp.ones(w_shape, dtype) * 0.5, "b": jnp.zeros((w_shape[1],), dtype)}


def loss_fn(p, batch):
    return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)


BATCH = {
    "x": jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32),
    "y": jnp.asarray(np.random.default_rng(1).normal(size=(16, 3)), jnp.float32),
}


def host(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


def tree_equal(a, b):
    la, lb = jax.tree.leaves(host(a)), jax.tree.leaves(host(b))
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb, strict=True)
    )


def residual(state):
    return host(state.opt_state[0].residual.value)


def replicated(state):
    """Everything but the per-replica residual."""
    return (state.step, state.params, state.opt_state[1:], state.nonfinite_count)


@pytest.fixture(scope="module")
def mesh8():
    return adaptjax.make_mesh(8)


@pytest.fixture(scope="module")
def mesh4():
    return adaptjax.make_mesh(4)


@pytest.fixture(scope="module")
def trained8(mesh8):
    """Two steps on 8 replicas: the residual differs between replicas."""
    step = adaptjax.data_parallel_step(loss_fn, TX, mesh8, donate=False)
    state = adaptjax.init_state(params_like(), TX, mesh8)
    for _ in range(2):
        state, _ = step(state, BATCH)
    r = residual(state)["w"]
    assert r.shape == (8, 4, 3) and not np.allclose(r[0], r[7])  # replica-dependent
    return state


def snapshot(root):
    """Every path under ``root`` with its size and modification time."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.stat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out


def test_save_on_8_restore_on_4_and_back_to_8(tmp_path, mesh8, mesh4, trained8):
    data = adaptjax.ArrayDataset(np.arange(100.0), seed=0)
    data.next_batch(32)
    meta = {
        "data": data.state_dict(),
        "config": {"mesh": (8,), "global_batch": 16, "microbatches": 1, "lr": 0.05},
        "codec": None,
        "policies": [{"name": "cooldown", "last": 3}],
    }
    ckpt = adaptjax.RunCheckpoints(tmp_path / "ckpt")
    ckpt.save(2, trained8, meta)
    assert ckpt.latest_step() == 2 and ckpt.all_steps() == [2]
    assert ckpt.read_meta() == json.loads(json.dumps(meta))  # tuples come back as lists

    # -- onto 4 replicas -------------------------------------------------------------------
    target4 = adaptjax.init_state(params_like(), TX, mesh4)
    state4, meta4 = ckpt.restore(target_state=target4, mesh=mesh4)
    assert meta4 == json.loads(json.dumps(meta))
    assert tree_equal(replicated(state4), replicated(trained8))  # params, adam moments, counts
    assert state4.params["w"].sharding == jax.sharding.NamedSharding(
        mesh4, jax.sharding.PartitionSpec()
    )
    saved, merged = residual(trained8), residual(state4)
    for k in saved:  # "mean" rule: every new replica holds the old replicas' mean
        assert merged[k].shape == (4, *saved[k].shape[1:])
        want = saved[k].mean(axis=0, dtype=np.float64).astype(np.float32)
        for i in range(4):
            np.testing.assert_array_equal(merged[k][i], want)
        np.testing.assert_allclose(merged[k].mean(0), saved[k].mean(0), rtol=1e-6, atol=1e-7)
    assert state4.opt_state[0].residual.value["w"].sharding.spec == jax.sharding.PartitionSpec(
        "data"
    )
    resumed = adaptjax.ArrayDataset(np.arange(100.0), seed=5)
    resumed.load_state_dict(meta4["data"])
    np.testing.assert_array_equal(resumed.next_batch(8), data.next_batch(8))

    # -- the restored state trains on the new mesh, on the same trajectory -------------------
    step4 = adaptjax.data_parallel_step(loss_fn, TX, mesh4)
    step8 = adaptjax.data_parallel_step(loss_fn, TX, mesh8, donate=False)
    after4, m4 = step4(state4, BATCH)
    after8, m8 = step8(trained8, BATCH)
    assert int(after4.step) == 3
    np.testing.assert_allclose(
        float(m4["loss"]), float(loss_fn(host(trained8.params), BATCH)), rtol=1e-6
    )
    for k in ("w", "b"):  # the global gradient does not depend on how the batch is split
        np.testing.assert_allclose(after4.params[k], after8.params[k], rtol=1e-5, atol=1e-6)

    # -- and back onto 8 replicas ---------------------------------------------------------
    ckpt.save(3, after4, {**meta, "config": {**meta["config"], "mesh": [4]}})
    target8 = adaptjax.init_state(params_like(), TX, mesh8)
    abstract8 = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), target8)
    back, meta8 = ckpt.restore(target_state=abstract8, mesh=mesh8)  # shapes suffice
    assert meta8["config"]["mesh"] == [4]
    assert tree_equal(replicated(back), replicated(after4))
    r4, r8 = residual(after4), residual(back)
    for k in r4:
        assert r8[k].shape == (8, *r4[k].shape[1:])
        want = r4[k].mean(axis=0, dtype=np.float64).astype(np.float32)
        for i in range(8):
            np.testing.assert_array_equal(r8[k][i], want)
    back, _ = step8(back, BATCH)
    assert int(back.step) == 4 and np.isfinite(np.asarray(back.params["w"])).all()

    # -- an older step onto its own replica count: nothing is merged -------------------------
    same, _ = ckpt.restore(2, target_state=target8, mesh=mesh8)
    assert tree_equal(same, trained8)
    ckpt.close()


def test_restore_into_an_nnx_model_keeps_the_target_graphdef(tmp_path, mesh8, mesh4):
    from flax import nnx

    def make():
        return nnx.Linear(4, 3, rngs=nnx.Rngs(0))

    tx = optax.chain(adaptjax.sync_gradients("data"), optax.sgd(0.1))
    nnx_loss = lambda model, b: jnp.mean((model(b["x"]) - b["y"]) ** 2)
    state = adaptjax.init_state(make(), tx, mesh8)
    state, _ = adaptjax.data_parallel_step(nnx_loss, tx, mesh8)(state, BATCH)
    with adaptjax.RunCheckpoints(tmp_path) as ckpt:
        ckpt.save(1, state, {})
        target = adaptjax.init_state(make(), tx, mesh4)
        restored, meta = ckpt.restore(target_state=target, mesh=mesh4)
    assert meta == {} and restored.graphdef == target.graphdef
    assert tree_equal(restored.params, state.params)
    restored, metrics = adaptjax.data_parallel_step(nnx_loss, tx, mesh4)(restored, BATCH)
    assert int(restored.step) == 2 and np.isfinite(float(metrics["loss"]))


def test_async_save_lets_the_state_be_donated_at_once(tmp_path, mesh8, trained8):
    step = adaptjax.data_parallel_step(loss_fn, TX, mesh8)  # donates its input state
    state = jax.tree.map(jnp.copy, trained8)
    expected = host(state)
    ckpt = adaptjax.RunCheckpoints(tmp_path)
    ckpt.save(7, state, {"k": 1}, wait=False)
    state, _ = step(state, BATCH)  # donated while Orbax may still be writing
    assert ckpt.latest_step() == 7  # waits for the background write
    restored, _ = ckpt.restore(target_state=trained8, mesh=mesh8)
    assert tree_equal(restored, expected)
    saved = state
    ckpt.save(8, state, {"k": 2})  # after a completed save, donation frees the buffers again
    state, _ = step(state, BATCH)
    if jax.__version_info__ < (0, 11):  # from jax 0.11 on, Orbax's host copy of the saved
        assert saved.params["w"].is_deleted()  # buffers (copy_to_host_async) pins them:
    after = state  # the step after the save copies instead; the next one donates again
    step(state, BATCH)
    assert after.params["w"].is_deleted()


def test_the_first_step_after_a_restore_donates_the_restored_state(tmp_path, mesh8, trained8):
    # Verifying the restored checksums reads the buffers on the host; that read must
    # leave nothing behind that stops donation (np.asarray of a whole array does, jax 0.11).
    with adaptjax.RunCheckpoints(tmp_path) as ckpt:
        ckpt.save(1, trained8, {})
        restored, _ = ckpt.restore(target_state=trained8, mesh=mesh8)
    adaptjax.data_parallel_step(loss_fn, TX, mesh8)(restored, BATCH)
    assert restored.params["w"].is_deleted()


def test_max_to_keep(tmp_path, trained8):
    ckpt = adaptjax.RunCheckpoints(tmp_path, max_to_keep=2)
    for s in (1, 2, 3, 4):
        ckpt.save(s, trained8, {"s": s})
    assert ckpt.all_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["3", "4"]
    assert ckpt.read_meta(3) == {"s": 3}


# -- refusing what doesn't fit ------------------------------------------------------------


def test_model_mismatch_is_refused_before_any_array_is_read(tmp_path, mesh4, trained8):
    ckpt = adaptjax.RunCheckpoints(tmp_path / "run")
    ckpt.save(2, trained8, {"x": 1})
    before = snapshot(tmp_path)
    items_read = []
    orbax_restore = ckpt._manager.restore

    def spy(step, *a, args=None, **k):
        items_read.extend(args.keys())
        return orbax_restore(step, *a, args=args, **k)

    ckpt._manager.restore = spy
    where = f"{tmp_path / 'run'}/2"
    cases = [
        (params_like((5, 3)), r"params\['w'\] is float32\[4, 3\] there, float32\[5, 3\] here"),
        (
            params_like(dtype=jnp.bfloat16),
            r"params\['b'\] is float32\[3\] there, bfloat16\[3\] here",
        ),
        ({**params_like(), "c": jnp.zeros(2)}, r"params\['c'\] is in target_state but not in the"),
        ({"w": params_like()["w"]}, r"params\['b'\] is in the checkpoint but not in target_state"),
    ]
    for params, detail in cases:
        target = adaptjax.init_state(params, TX, mesh4)
        with pytest.raises(ValueError) as e:
            ckpt.restore(target_state=target, mesh=mesh4)
        msg = str(e.value)
        assert "\n" not in msg
        assert msg.startswith(f"checkpoint at {where} was written for a different model: ")
        assert msg.endswith("; point run_dir elsewhere")
        assert re.search(detail, msg), msg
    other_tx = optax.chain(error_feedback_like(), adaptjax.sync_gradients("data"), optax.sgd(0.1))
    with pytest.raises(
        ValueError,
        match=r"^checkpoint at .* was written with a different optimizer or model state: ",
    ):
        ckpt.restore(target_state=adaptjax.init_state(params_like(), other_tx, mesh4), mesh=mesh4)
    assert items_read and "state" not in items_read  # only the JSON meta item was read
    assert snapshot(tmp_path) == before  # nothing on disk changed


def test_directory_under_a_regular_file_is_refused_before_writing(tmp_path, trained8):
    afile = tmp_path / "afile"
    afile.write_text("not a directory")
    before = snapshot(tmp_path)
    ckpt = adaptjax.RunCheckpoints(afile / "ckpt")  # construction writes nothing
    with pytest.raises(ValueError) as e:
        ckpt.save(1, trained8, {})
    assert str(e.value) == (
        f"checkpoint directory {afile / 'ckpt'} cannot be created: {afile} is a file, not a "
        "directory; point run_dir elsewhere (a writable directory)"
    )
    assert snapshot(tmp_path) == before and afile.read_text() == "not a directory"


def test_read_only_directory_is_refused_before_writing(tmp_path, trained8, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            # running as root: chmod does not stop root from writing, so make the
            # permission check see what an ordinary user would
            real_access = os.access
            monkeypatch.setattr(
                os, "access", lambda p, mode: False if str(p) == str(ro) else real_access(p, mode)
            )
        ckpt = adaptjax.RunCheckpoints(ro / "ckpt")
        with pytest.raises(ValueError) as e:
            ckpt.save(1, trained8, {})
        assert str(e.value) == (
            f"checkpoint directory {ro / 'ckpt'} is not writable ({ro} denies write access); "
            "point run_dir elsewhere (a writable directory) or fix its permissions"
        )
        assert os.listdir(ro) == []
    finally:
        ro.chmod(0o700)


def test_half_written_checkpoint_is_ignored(tmp_path, mesh8, trained8):
    ckpt = adaptjax.RunCheckpoints(tmp_path)
    ckpt.save(1, trained8, {"step": 1})
    # what a save interrupted before its final rename leaves behind (Orbax's temp naming)
    tmp = tmp_path / "2.orbax-checkpoint-tmp-1712345678901234"
    shutil.copytree(tmp_path / "1", tmp)
    (tmp / "commit_success.txt").unlink()
    fresh = adaptjax.RunCheckpoints(tmp_path)
    for manager in (ckpt, fresh):
        assert manager.latest_step() == 1 and manager.all_steps() == [1]
        state, meta = manager.restore(target_state=trained8, mesh=mesh8)
        assert meta == {"step": 1} and tree_equal(state, trained8)
    fresh.save(2, trained8, {"step": 2})  # the leftover does not block the next save
    assert fresh.latest_step() == 2 and fresh.read_meta() == {"step": 2}


@pytest.mark.slow
def test_process_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, mesh8, trained8):
    """A real process dies just before Orbax's final rename; a new process restores step 1."""
    script = textwrap.dedent(
        f"""
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        os.environ["JAX_PLATFORMS"] = "cpu"
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import adaptjax
        from orbax.checkpoint._src.path import atomicity
        from test_checkpoint_restore import TX, params_like

        state = adaptjax.init_state(params_like(), TX, adaptjax.make_mesh(8))
        ckpt = adaptjax.RunCheckpoints(sys.argv[1])
        ckpt.save(1, state, {{"step": 1}})
        async def die(self, *a, **k):
            os._exit(17)  # the process dies with all bytes written, before the commit
        atomicity.AtomicRenameTemporaryPath.finalize = die
        ckpt.save(2, state, {{"step": 2}})
        """
    )
    (tmp_path / "crash.py").write_text(script)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "crash.py"), str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 17, proc.stderr[-2000:]
    names = os.listdir(run_dir)
    assert "1" in names and "2" not in names
    assert any(n.startswith("2.orbax-checkpoint-tmp") for n in names), names
    ckpt = adaptjax.RunCheckpoints(run_dir)
    assert ckpt.latest_step() == 1
    target = adaptjax.init_state(params_like(), TX, mesh8)
    state, meta = ckpt.restore(target_state=target, mesh=mesh8)
    assert meta == {"step": 1} and tree_equal(state, target)  # step 1 held the initial state


# -- bad inputs ---------------------------------------------------------------------------


def test_bad_save_arguments(tmp_path, trained8):
    ckpt = adaptjax.RunCheckpoints(tmp_path / "c")
    with pytest.raises(ValueError, match=r"^step must be a non-negative integer, got -1$"):
        ckpt.save(-1, trained8, {})
    with pytest.raises(ValueError, match=r"^state must be an adaptjax.TrainState \(from"):
        ckpt.save(1, {"params": 1}, {})
    with pytest.raises(ValueError, match=r"^meta must be a dict, got list$"):
        ckpt.save(1, trained8, [1])
    with pytest.raises(
        ValueError, match=r"^meta must be JSON-serialisable \(Object of type ndarray is not JSON"
    ) as e:
        ckpt.save(1, trained8, {"cursor": np.arange(3)})
    assert "\n" not in str(e.value)
    assert not (tmp_path / "c").exists()  # nothing written by any refused save
    ckpt.save(5, trained8, {})
    for s in (5, 3):
        with pytest.raises(
            ValueError, match=rf"^checkpoint step {s} is not after the latest step 5 in .*c; "
        ):
            ckpt.save(s, trained8, {})
    with pytest.raises(ValueError, match=r"^max_to_keep must be an integer >= 1 or None, got 0$"):
        adaptjax.RunCheckpoints(tmp_path, max_to_keep=0)
    with pytest.raises(
        ValueError, match=r"^RunCheckpoints takes a local directory, got gs://b/run; mount"
    ):
        adaptjax.RunCheckpoints("gs://b/run")


def test_bad_restore_arguments(tmp_path, mesh4, trained8):
    ckpt = adaptjax.RunCheckpoints(tmp_path / "empty")
    target = adaptjax.init_state(params_like(), TX, mesh4)
    with pytest.raises(ValueError, match=r"^no complete checkpoint in .*empty; save one first"):
        ckpt.restore(target_state=target, mesh=mesh4)
    with pytest.raises(ValueError, match=r"^no complete checkpoint in .*empty"):
        ckpt.read_meta()
    ckpt.save(1, trained8, {})
    with pytest.raises(
        ValueError, match=r"^no complete checkpoint for step 9 in .*empty; complete steps: \[1\]$"
    ):
        ckpt.restore(9, target_state=target, mesh=mesh4)
    with pytest.raises(ValueError, match=r"^target_state must be an adaptjax.TrainState"):
        ckpt.restore(target_state=target.params, mesh=mesh4)
    with pytest.raises(ValueError, match=r"^mesh axes \('x',\) have no 'data' axis"):
        ckpt.restore(
            target_state=target, mesh=jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
        )
    shutil.rmtree(tmp_path / "empty" / "1" / "meta")
    with pytest.warns(UserWarning, match=r"empty/1 is not an adaptjax checkpoint \(no state/meta"):
        with pytest.raises(ValueError, match=r"^no complete checkpoint in .*empty; save one"):
            ckpt.restore(target_state=target, mesh=mesh4)
