"""Two processes on localhost, 2 CPU devices each, one program (`jax.distributed`, gloo):
training a model sharded over the 4 global devices with a `memox.jit` step. Every process
must hold the same bits (results, parameters, and the slots' keys: a key that differs
between processes makes one hit where another misses, issue 19 item 2), equal to the
unmemoized run, with the frozen part's hits. Each process is `tests/multiprocess_worker.py`
and writes what it saw to a file; this test compares the files."""

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest


WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")
STEPS = 4


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(out, *options, wait=120):
    """Both processes of one run; each exits by itself (bounded by `timeout`), and only
    these processes are killed if they outlive the wait."""
    port = _free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    procs = [
        subprocess.Popen(
            ["timeout", str(wait), sys.executable, WORKER, str(port), str(i), str(out), *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i in range(2)
    ]
    deadline, logs = time.monotonic() + wait + 10, []
    try:
        for proc in procs:
            stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            logs.append(stdout.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, log in zip(procs, logs):
        assert proc.returncode == 0, log[-4000:]
    return [dict(np.load(out / f"{i}.npz")) for i in range(2)]


# (`drift` is `heavy`: the default suite keeps this file under 30 s.)
@pytest.mark.parametrize("policy", ["exact", pytest.param("drift", marks=pytest.mark.heavy)])
def test_two_processes_agree_and_match_the_unmemoized_run(tmp_path, policy):
    first, second = _run(tmp_path, "--policy", policy, "--steps", str(STEPS))
    assert first.keys() == second.keys()
    for name in first:  # every array, the slots' keys included: one answer everywhere
        assert first[name].tobytes() == second[name].tobytes(), name
    for name in first:
        if name.startswith("reference."):
            model = first[name.replace("reference.", "model.")]
            assert model.tobytes() == first[name].tobytes(), name
    assert first["losses"].tobytes() == first["ref_losses"].tobytes()
    assert tuple(first["stats.frozen"]) == (STEPS - 1, 1)  # (hits, misses)
    assert tuple(first["stats.trained"]) == (0, STEPS)


def test_a_checkpoint_restored_in_fresh_processes_goes_on_hitting(tmp_path):
    pytest.importorskip("orbax.checkpoint")
    checkpoint = tmp_path / "checkpoint"
    (tmp_path / "first").mkdir()
    (tmp_path / "restored").mkdir()
    save = ["--steps", str(STEPS), "--save-at", "2", "--checkpoint", str(checkpoint)]
    first, _ = _run(tmp_path / "first", *save)
    restored, other = _run(tmp_path / "restored", *save, "--restore")
    for name in restored:  # both processes agree
        assert restored[name].tobytes() == other[name].tobytes(), name
    for name in restored:  # and go on as the uninterrupted run: the frozen part hits
        expected = first[name][2:] if name == "losses" else first[name]
        assert restored[name].tobytes() == expected.tobytes(), name
    assert tuple(restored["stats.frozen"]) == (STEPS - 1, 1)
