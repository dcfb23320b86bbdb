"""benchmarks/device.sh: skipped without a GPU, and every command it runs takes its flags."""

import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "device.sh")


def _run(*args):
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    return subprocess.run(["bash", SCRIPT, *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False)


def test_without_a_gpu_it_says_so_and_exits_0():
    proc = _run()
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "benchmarks/device.sh: jax sees no GPU (platform: cpu); skipped"


def test_every_command_names_a_script_and_flags_it_has():
    proc = _run("--dry-run")
    assert proc.returncode == 0, proc.stderr
    commands = [line.split()[2:] for line in proc.stdout.splitlines()]
    assert len(commands) == 5
    for command in commands:
        script, flags = command[1], [a for a in command[2:] if a.startswith("--")]
        assert os.path.isfile(os.path.join(ROOT, script)), script
        source = open(os.path.join(ROOT, script)).read()
        for flag in flags:  # each flag is one the script's argparse defines
            assert re.search(rf"add_argument\(\s*\"{flag}\"", source), (script, flag)
