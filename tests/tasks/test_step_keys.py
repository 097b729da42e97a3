"""Per-step cache keys: a step's key covers the code it can run, and nothing else (lrkv_tasks.keys).

The closure rules are checked on a synthetic package in ``tmp_path`` (the repository is never edited), and
on the real packages: which modules each step reaches, and that every lrkv function a real step executes
(traced while it runs) lies in its closure.
"""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

import lrkv_core
from lrkv_core.system.code_fingerprint import CodeIndex, normalized_dump
from lrkv_tasks import convert as t
from lrkv_tasks.keys import code_index, step_code, task_key
from tests.support.models import tiny_model_dir, token_parquet

TOY = {
    "__init__.py": '''
        """A package that re-exports everything."""
        from . import plugins  # noqa: F401  (registration)
        from .base import REGISTRY, shared
        from .heavy import heavy
        from .steps import step_a, step_b
    ''',
    "base.py": """
        REGISTRY = {}

        def register(cls):
            REGISTRY[cls.name] = cls
            return cls

        def shared(x):
            return x + 1
    """,
    "plugins.py": """
        from .base import register

        @register
        class Plugin:
            name = "plugin"
    """,
    "heavy.py": """
        def heavy(x):
            return x * 100
    """,
    "helpers.py": """
        def helper(x):
            return x * 2

        def unused(x):
            return x - 1
    """,
    "steps.py": '''
        """Two steps: one reads a helper and a re-exported name, one imports inside itself."""
        from . import helpers
        from .base import shared  # through the module, not the package
        from .heavy import heavy

        def step_a(x):
            """Doubles."""
            return helpers.helper(shared(x))

        def step_b(x):
            from . import REGISTRY
            return heavy(len(REGISTRY))
    ''',
}


def _write(path: Path, text: str, ns: int) -> None:
    path.write_text(textwrap.dedent(text).lstrip())
    os.utime(path, ns=(ns, ns))  # an explicit mtime: the parse cache never depends on the clock


@pytest.fixture
def toy(tmp_path):
    root = tmp_path / "toy"
    root.mkdir()
    for i, (name, text) in enumerate(TOY.items()):
        _write(root / name, text, 10**18 + i)
    index = CodeIndex({"toy": root})

    def edit(name: str, old: str, new: str) -> None:
        path = root / name
        stamp = path.stat().st_mtime_ns + 1_000_000
        _write(path, textwrap.dedent(TOY[name]).lstrip().replace(old, new), stamp)
        index.refresh()  # a process reads the sources once; this test plays several processes

    return SimpleNamespace(root=root, index=index, edit=edit)


def _key(index: CodeIndex, name: str) -> str:
    return index.fingerprint([("name", "toy.steps", name)])


def test_normalized_sources_ignore_docstrings_comments_and_formatting():
    a = 'def f(x):\n    """Doc."""\n    return x + 1  # one\n'
    b = "def f( x ):\n    # a comment\n\n    return (x+1)\n"
    assert normalized_dump(a) == normalized_dump(b)
    assert normalized_dump(a) != normalized_dump(a.replace("x + 1", "x + 2"))


def test_closure_follows_reads_not_whole_modules(toy):
    reached = toy.index.closure([("name", "toy.steps", "step_a")])
    modules = {m for m, _ in reached}
    assert {"toy.steps", "toy.helpers", "toy.base"} <= modules
    assert "toy.heavy" not in modules  # imported by steps.py, but step_a never reads it
    b = {m for m, _ in toy.index.closure([("name", "toy.steps", "step_b")])}
    # the package re-exports everything; step_b imports only REGISTRY from it, which brings in its plugins
    assert {"toy.heavy", "toy", "toy.base", "toy.plugins"} <= b and "toy.helpers" not in b


def test_docstring_comment_and_format_edits_keep_every_key(toy):
    before = {name: _key(toy.index, name) for name in ("step_a", "step_b")}
    toy.edit("steps.py", '"""Doubles."""', '"""Doubles its input, after the shared step."""')
    toy.edit("helpers.py", "return x * 2", "return (x  *  2)  # twice")
    toy.edit("__init__.py", "re-exports everything", "re-exports all of its names")
    assert {name: _key(toy.index, name) for name in before} == before


def test_code_edits_change_exactly_the_keys_of_steps_that_run_them(toy):
    a, b = _key(toy.index, "step_a"), _key(toy.index, "step_b")
    toy.edit("helpers.py", "return x - 1", "return x - 2")  # a function no step reads
    assert (_key(toy.index, "step_a"), _key(toy.index, "step_b")) == (a, b)
    toy.edit("helpers.py", "return x * 2", "return x * 3")
    assert _key(toy.index, "step_a") != a and _key(toy.index, "step_b") == b
    toy.edit("heavy.py", "x * 100", "x * 101")  # reached by step_b's import inside the function
    assert _key(toy.index, "step_b") != b


def test_a_registered_method_is_part_of_every_step_that_reads_its_registry(toy):
    b = _key(toy.index, "step_b")
    a = _key(toy.index, "step_a")  # reads base.shared: base is the registry's module too
    toy.edit("plugins.py", 'name = "plugin"', 'name = "renamed"')
    assert _key(toy.index, "step_b") != b and _key(toy.index, "step_a") != a


def test_import_time_effects_are_part_of_every_key(toy):
    a = _key(toy.index, "step_a")
    _write(toy.root / "side.py", "import os\n\nos.environ.setdefault('TOY', '1')\n", 10**18)
    toy.index.refresh()
    assert _key(toy.index, "step_a") != a  # a module no step imports, with an effect on every process


def _reached(entry: str) -> set[str]:
    module, name = entry.rsplit(".", 1)
    return code_index().modules_reached([("name", module, name)])


def test_real_steps_reach_their_own_code_only():
    gram = _reached("lrkv_tasks.convert.collect_statistic")
    assert {"lrkv_core.statistics.gram", "lrkv_core.statistics.base", "lrkv_core.conversion.pipeline"} <= gram
    assert not {
        m for m in gram if m.startswith("lrkv_core.allocation") or m == "lrkv_core.evaluation.metrics"
    }
    assert "lrkv_core.lora.train" not in gram and "lrkv_core.conversion.refine" not in gram
    assert "lrkv_core.decompositions.whitened" in _reached("lrkv_tasks.convert.decompose_layer")
    plan = _reached("lrkv_tasks.convert.plan_ranks")
    assert {"lrkv_core.allocation.lorc", "lrkv_core.allocation.uniform"} <= plan
    assert "lrkv_core.statistics.fisher" not in plan
    assert "lrkv_core.evaluation.metrics" in _reached("lrkv_tasks.convert.evaluate")
    assert "lrkv_core.lora.train" in _reached("lrkv_tasks.lora.lora_recover")


def test_task_keys_differ_by_statistic_and_step(monkeypatch):
    monkeypatch.setattr("lrkv_tasks.keys.fingerprint", lambda obj: obj)  # see what is hashed

    def key(task, **params):
        return task_key(SimpleNamespace(task=task), params)

    gram, fisher = (
        key(t.collect_statistic, statistic={"name": "gram"}),
        key(t.collect_statistic, statistic={"name": "fisher"}),
    )
    assert gram != fisher and gram["code"] == fisher["code"] == step_code(
        "lrkv_tasks.convert", "collect_statistic"
    )
    assert gram["code"] != key(t.decompose_layer)["code"]
    assert gram["code"].startswith(lrkv_core.__version__ + "+")


def test_a_task_function_outside_the_packages_gets_all_their_code():
    index = code_index()
    everything = index.fingerprint([("module", m) for m in index.modules()])
    assert step_code(__name__, "a_test_task") == f"{lrkv_core.__version__}+{everything[:16]}"
    assert step_code("lrkv_tasks.convert", "no_such_task").endswith(everything[:16])


def _statement_of(index: CodeIndex, module: str, line: int) -> tuple[str, str] | None:
    mod = index.source(module)
    for stmt, digest in zip(mod.body, mod.digests, strict=True):
        start = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
        if start <= line <= stmt.end_lineno:
            return module, digest
    return None


@pytest.mark.slow
def test_every_function_a_real_step_executes_is_in_its_closure(tmp_path):
    """Soundness on real code: trace the lrkv functions each step calls while it runs."""
    for module in code_index().modules():
        __import__(module)  # nothing runs at import time under the trace
    index = CodeIndex(code_index().packages)  # the sources of the code just loaded
    files = {index.source(m).path: m for m in index.modules()}

    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'calib.parquet', rows=8, seq_len=32)}"
    store = str(tmp_path / "store")

    def traced(task, *args):
        calls: set[tuple[str, int]] = set()

        def profile(frame, event, arg):
            if event == "call" and frame.f_code.co_filename in files and frame.f_code.co_name != "<module>":
                calls.add((files[frame.f_code.co_filename], frame.f_code.co_firstlineno))

        sys.setprofile(profile)
        try:
            out = task.fn(*args)
        finally:
            sys.setprofile(None)
        closure = index.closure([("name", task.fn.__module__, task.fn.__name__)])
        missing = {c for c in calls if _statement_of(index, *c) not in closure}
        assert not missing, f"{task.name} ran code outside its key: {sorted(missing)}"
        ran.append(calls)
        return out

    ran: list[set[tuple[str, int]]] = []

    model = traced(t.resolve_model, str(model_dir))
    calib = traced(t.extract_calibration, model, data, 4, 32, 0, store)
    gram = traced(t.collect_statistic, model, calib, {"name": "gram"}, "float32", 4, store)
    # the check can fail: the Gram pass runs code that another step's closure does not hold
    export = index.closure([("name", "lrkv_tasks.convert", "export_model")])
    assert any(_statement_of(index, *c) not in export for c in ran[-1])
    fisher = traced(t.collect_statistic, model, calib, {"name": "fisher"}, "float32", 4, store)
    keys = traced(t.collect_statistic, model, calib, {"name": "output_fisher"}, "float32", 4, store)
    mixed = traced(t.collect_statistic, model, calib, {"name": "attention_gram"}, "float32", 4, store)
    stats = {"gram": gram, "output_fisher": keys, "attention_gram": mixed}
    layers = [traced(t.decompose_layer, model, stats, i, 2, {"name": "whitened"}, store) for i in range(2)]
    summaries = [traced(t.summarize_layer, f, {"fisher": fisher}, ["error_curves"], store) for f in layers]
    plan = traced(t.plan_ranks, model, summaries, 0.5, 2, 4, {"name": "fisher-greedy"}, store)
    built = traced(
        t.build_model, model, layers, plan, {"name": "whitened"}, {"name": "dense"}, "float32", store
    )
    ev = {
        "dataset": data,
        "seq_len": 32,
        "max_windows": 2,
        "decode_prefix": 16,
        "decode_windows": 1,
        "batch_size": 2,
    }
    traced(t.evaluate, built, ev, "float32", "compressed", model, store)
