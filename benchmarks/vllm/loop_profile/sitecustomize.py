"""Profile vLLM's engine-core steps in a ``vllm serve`` process tree (a benchmark tool).

``vllm_serve.py --profile-loop`` puts this folder first on the servers' ``PYTHONPATH`` and sets
``KVTIER_LOOP_PROFILE`` to a folder; Python imports this module at start in every process of the
server. It waits, through an import hook, for ``vllm.v1.engine.core`` and then wraps
``EngineCore.step`` and ``EngineCore.step_with_batch_queue`` (one engine step: scheduling, the
connector's scheduler and worker hooks, the forward, the output processing) in one
``cProfile.Profile`` per process, switched on only inside a step. Every ``DUMP_EVERY_S`` seconds
and at exit it writes ``<folder>/loop_<pid>.txt``: the steps' count and wall time, then the
functions by own time and by cumulative time. Both servers of a comparison get the same
wrapping, so their profiles compare (cProfile slows Python code a few times over: read the
shares, not the absolute times). Runs on the thread that runs the steps.
"""

from __future__ import annotations

import atexit
import cProfile
import importlib.abc
import importlib.util
import io
import os
import pstats
import sys
import time

DUMP_EVERY_S = 5.0
TARGET = "vllm.v1.engine.core"
_FOLDER = os.environ.get("KVTIER_LOOP_PROFILE", "")


class _Profile:
    """One process's profile of its engine steps."""

    def __init__(self, folder: str) -> None:
        self.path = os.path.join(folder, f"loop_{os.getpid()}.txt")
        self.profile = cProfile.Profile()
        self.steps, self.wall_s, self.depth = 0, 0.0, 0
        self.last_dump = time.monotonic()

    def wrap(self, fn):
        def step(*args, **kwargs):
            if self.depth:                       # a step inside a step: already counted
                return fn(*args, **kwargs)
            self.depth += 1
            started = time.perf_counter()
            self.profile.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                self.profile.disable()
                self.depth -= 1
                self.steps += 1
                self.wall_s += time.perf_counter() - started
                if time.monotonic() - self.last_dump > DUMP_EVERY_S:
                    self.dump()
        step.__wrapped__ = fn
        return step

    def dump(self) -> None:
        self.last_dump = time.monotonic()
        if not self.steps:
            return
        text = io.StringIO()
        text.write(f"pid {os.getpid()}: {self.steps} engine steps, {self.wall_s:.3f} s inside "
                   f"them (profiled)\n")
        stats = pstats.Stats(self.profile, stream=text)
        for key, count in (("tottime", 45), ("cumulative", 70)):
            text.write(f"\n==== by {key} ====\n")
            stats.sort_stats(key).print_stats(count)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as out:
            out.write(text.getvalue())
        os.replace(tmp, self.path)


class _Hook(importlib.abc.MetaPathFinder):
    """Wraps the engine core's step functions right after their module is imported."""

    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            _install(module)
        loader.exec_module = exec_module
        return spec


def _install(module) -> None:
    core = getattr(module, "EngineCore", None)
    if core is None:
        return
    profile = _Profile(_FOLDER)
    for name in ("step", "step_with_batch_queue"):
        fn = getattr(core, name, None)
        if fn is not None:
            setattr(core, name, profile.wrap(fn))
    atexit.register(profile.dump)


if _FOLDER:
    os.makedirs(_FOLDER, exist_ok=True)
    sys.meta_path.insert(0, _Hook())
