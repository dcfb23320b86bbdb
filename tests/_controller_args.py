"""The tests' shorthand for a Controller: one dictionary of settings, split into the
Controller's arguments (code, :class:`adaptjax.RunSpec`, hooks).

Test jobs keep their settings in one dictionary that a test overrides key by
key (``job_kwargs(policies=[], checkpoint_every=None)``); :func:`make_controller`
and :func:`resume_controller` build the spec, the option groups and the hooks
those keys name. ``progress`` and ``tensorboard`` default to off here (tests
write no bars and no event files unless they ask).
"""

from __future__ import annotations

import adaptjax

CODE = ("model", "loss_fn", "optimizer", "data")
GROUPS = {
    "checkpoint": (adaptjax.CheckpointOptions, {"checkpoint_every": "every",
                                                "max_to_keep": "max_to_keep"}),
    "compile": (adaptjax.CompileOptions, {"compilation_cache_dir": "cache_dir",
                                          "precompile_upcoming": "precompile_upcoming",
                                          "device_memory": "device_memory"}),
}


def controller_args(**kw) -> dict:
    """``Controller``'s keyword arguments from the flat settings ``kw``."""
    kw = dict(kw)
    args = {k: kw.pop(k) for k in CODE if k in kw}
    hooks = list(kw.pop("hooks", []))
    if kw.pop("progress", False):
        hooks.append(adaptjax.ProgressBar())
    if kw.pop("tensorboard", False):
        hooks.append(adaptjax.TensorBoard())
    eval_fn, eval_every = kw.pop("eval_fn", None), kw.pop("eval_every", None)
    if eval_fn is not None:
        hooks.append(adaptjax.Evaluate(eval_fn, every=eval_every))
    on_step = kw.pop("on_step", None)
    if on_step is not None:
        hooks.append(adaptjax.Hook(on_step))
    args["hooks"] = hooks
    for field, (cls, keys) in GROUPS.items():
        given = {name: kw.pop(key) for key, name in keys.items() if key in kw}
        if given:
            kw[field] = cls(**given)
    args["spec"] = adaptjax.RunSpec(**kw)
    return args


def make_controller(**kw) -> adaptjax.Controller:
    """``adaptjax.Controller`` of the flat settings ``kw``."""
    return adaptjax.Controller(**controller_args(**kw))


def resume_controller(run_dir=None, **kw) -> adaptjax.Controller:
    """``adaptjax.Controller.resume`` of the flat settings ``kw`` (with the spec they name;
    ``spec=None`` resumes with the saved one)."""
    if "run_dir" not in kw and run_dir is not None:
        kw["run_dir"] = run_dir
    spec_given = kw.pop("spec", ...)
    args = controller_args(**kw)
    if spec_given is not ...:
        args["spec"] = spec_given
    return adaptjax.Controller.resume(run_dir, **args)
