"""``--steady-malloc`` of the overhead benchmarks: one restart, argv kept, glibc's settings set."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")


def test_restart_with_steady_malloc_execs_once_with_the_settings_and_the_same_argv(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {BENCH!r})
        from monitor_overhead import STEADY_MALLOC, malloc_setting, restart_with_steady_malloc
        print("start", malloc_setting(), sys.argv[1:], flush=True)
        restart_with_steady_malloc()
        print("after", malloc_setting(), sys.argv[1:],
              [os.environ[k] for k in sorted(STEADY_MALLOC)], flush=True)
    """))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, str(script), "--steps", "3"], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    # The first process restarts itself before "after"; the second sees the settings
    # already in force and goes on.
    assert lines == [
        "start default ['--steps', '3']",
        "start steady ['--steps', '3']",
        f"after steady ['--steps', '3'] {['1', str(32 << 20), str(4 << 30)]}",
    ]
