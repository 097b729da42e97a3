"""What ``lrkv`` refuses before any work, as a user sees it: one line, exit code 1, no traceback."""

import os
import pickle
import signal
import subprocess
import sys

import pytest

from lrkv_core import convert, load_model, save_compressed
from lrkv_core.conversion.convert import CompressionConfig
from tests.support.models import SHARED, tiny_model, tiny_model_dir, token_parquet

SHAKESPEARE = SHARED / "models" / "shakespeare-llama"


def _lrkv(args, home, timeout=180):
    env = {**os.environ, "LRKV_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    env.pop("PREFECT_LOCAL_STORAGE_PATH", None)
    return subprocess.run(
        [sys.executable, "-m", "lrkv_flows.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def _convert(model, data, out, home):
    args = ["convert", "--model", str(model), "--dataset", data, "--out", str(out), "--n-samples", "8"]
    return _lrkv([*args, "--seq-len", "32", "--set", "eval.decode_prefix=16"], home)


def _one_line_error(res, message):
    text = " ".join(res.stdout.split())  # rich wraps long lines
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    assert f"error: {message}" in text, res.stdout[-2000:]
    assert "Traceback" not in res.stdout + res.stderr


def test_sources_and_outputs_that_would_fail_late_are_refused_up_front(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    home = tmp_path / "home"

    blocker = tmp_path / "a-file"  # --out below a file: not writable, whoever runs the test
    blocker.write_text("")
    res = _convert(model_dir, data, blocker / "out", home)
    _one_line_error(res, f"--out {blocker / 'out'} cannot be created: {blocker} is not a directory")
    assert "MLflow run" not in res.stdout  # refused before any work, not after the run was logged

    model, _ = load_model(model_dir)
    compressed = tmp_path / "compressed"
    save_compressed(
        convert(model, None, CompressionConfig(decomposition="plain", allocator="uniform")), compressed
    )
    _one_line_error(
        _convert(compressed, data, tmp_path / "out", home),
        f"--model {compressed} is already an lrkv compressed",
    )

    pickled = tmp_path / "pickled"
    tiny_model().save_pretrained(pickled)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": "as a pickle"}))
    _one_line_error(
        _convert(pickled, data, tmp_path / "out", home),
        f"--model {pickled} has no model.safetensors (only pytorch_model.bin); lrkv reads safetensors",
    )
    assert not (tmp_path / "out").exists()


def test_text_that_is_not_utf8_is_one_line_naming_the_file(tmp_path):
    if not SHAKESPEARE.is_dir():
        pytest.skip(f"shared model {SHAKESPEARE} is absent")
    text = tmp_path / "latin1.txt"
    text.write_bytes(("To be, or not to be: that is the question. " * 40).encode() + "café".encode("latin-1"))
    res = _lrkv(["eval", str(SHAKESPEARE), "--dataset", f"text:{text}", "--seq-len", "32"], tmp_path / "home")
    _one_line_error(res, f"text:{text}: {text} is not UTF-8 text (byte 0xe9 at offset 1723)")


def test_progress_lines_are_printed_as_they_come_when_the_output_is_not_a_terminal(tmp_path):
    """Captured output is not a terminal: each long step prints timestamped lines (start, progress, end)
    while the conversion runs, instead of a bar drawn once at the end."""
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    res = _convert(model_dir, data, tmp_path / "out", tmp_path / "home")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    lines = [
        line.split(" ", 1) for line in res.stdout.splitlines() if line[:2].isdigit() and line[2:3] == ":"
    ]
    steps = [message for _, message in lines]
    expected = [
        f"extract calibration from {data}[:90%]: started",
        "collect attention_gram,gram,output_fisher (one pass): 8/8",
        "decompose layer 1: done in",
        "build model: done in",
        "evaluate compressed: started",
        f"export to {tmp_path / 'out'}: done in",
    ]
    found = [next((i for i, m in enumerate(steps) if m.startswith(e)), None) for e in expected]
    assert None not in found and found == sorted(found), (found, steps)


def test_progress_lines_print_names_as_they_are():
    """A line's text is printed as it is: ``…-v1:train: started`` is not rich's ``:train:`` emoji."""
    import logging

    from lrkv_flows.report import console, progress_lines

    line = "extract calibration from hf:wikitext:wikitext-2-raw-v1:train: started"
    with console.capture() as captured, progress_lines():
        logging.getLogger("lrkv").info(line)
    assert captured.get().rstrip("\n").endswith(f" {line}"), captured.get()


def test_ctrl_c_while_the_command_loads_is_one_line_and_exit_130(tmp_path):
    """SIGINT while ``lrkv`` imports torch and transformers: one line and 130, no traceback. The signal is
    sent once the child reports (``-X importtime``, in import order) that torch has loaded, so it lands
    while the command's modules are still loading, whatever the machine's speed."""
    env = {**os.environ, "LRKV_HOME": str(tmp_path / "home")}
    args = [sys.executable, "-X", "importtime", "-m", "lrkv_flows", "runs", "list"]
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.split("|")[-1].strip() == "torch":
            proc.send_signal(signal.SIGINT)
            break
    rest, tail = proc.communicate(timeout=120)
    errors = "".join(seen) + tail
    assert seen and seen[-1].split("|")[-1].strip() == "torch", "torch was never imported"
    assert proc.returncode == 130, errors[-2000:]
    assert "interrupted (SIGINT) while lrkv was starting" in errors and "Traceback" not in errors + rest


def test_the_command_skips_the_interpreter_s_last_collection_at_exit(tmp_path):
    """The objects a command loaded are frozen by its last exit handler (:mod:`lrkv_flows.exiting`), after
    every other one: an exit handler registered before the command runs sees them frozen."""
    probe = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('FROZEN', gc.get_freeze_count(), flush=True))\n"
        "from lrkv_flows.main import main\nsys.argv = ['lrkv', '--version']\nmain()\n"
    )
    env = {**os.environ, "LRKV_HOME": str(tmp_path / "home")}
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0 and res.stdout.startswith("lrkv "), res.stdout + res.stderr
    frozen = int(res.stdout.split("FROZEN")[1])
    assert frozen > 10_000, res.stdout  # the modules' objects, not a handful


def test_the_command_list_loads_no_command_and_each_command_loads_on_its_own(tmp_path):
    """``lrkv --help`` lists every command with its summary without importing any command's module (nor
    torch, Prefect or MLflow); a command's own help loads that command only; a mistyped command names the
    close ones, loaded or not. No help shows a flag with a type, as if it took a value."""
    from typer.testing import CliRunner

    from lrkv_flows.cli import COMMANDS, app, load_command

    probe = (
        "import sys\nfrom lrkv_flows.main import main\nsys.argv = ['lrkv', *sys.argv[1:]]\ntry:\n    main()\n"
        "except SystemExit:\n    pass\nprint('LOADED', sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'prefect', 'mlflow', 'lrkv_core') or m.startswith('lrkv_flows.commands.')))"
    )
    env = {**os.environ, "LRKV_HOME": str(tmp_path / "home"), "COLUMNS": "200"}

    def lrkv(*args):
        res = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, env=env)
        assert "Traceback" not in res.stderr, res.stderr[-2000:]
        out, _, loaded = res.stdout.rpartition("LOADED ")
        return " ".join((out + res.stderr).replace("│", " ").split()), eval(loaded)

    listing, loaded = lrkv("--help")
    assert loaded == [], loaded
    from lrkv_core.version import __version__

    assert lrkv("--version") == (f"lrkv {__version__}", [])
    for name, (_, summary) in COMMANDS.items():
        assert f" {name} {summary} " in listing, (name, listing)
    assert not (tmp_path / "home").exists()
    assert " --help Show this message and exit. " in listing and "<bool>" not in listing

    text, loaded = lrkv("eval", "--help")
    assert "Usage: lrkv eval [OPTIONS] {model_dir}" in text and "--dataset" in text
    assert "lrkv_flows.commands.evaluate" in loaded and "lrkv_flows.commands.convert" not in loaded

    text, loaded = lrkv("convrt")
    assert "No such command 'convrt'. Did you mean 'convert'?" in text and loaded == []

    for name, (_, summary) in COMMANDS.items():  # each entry names a command that loads, under its name
        command = load_command(name)
        assert (command.name, command.short_help) == (name, summary) and command.help
        for words in [[name], *([name, sub] for sub in getattr(command, "commands", {}))]:
            help_text = CliRunner().invoke(app, [*words, "--help"], env={"COLUMNS": "200"}).output
            assert " --help " in help_text and "<bool>" not in help_text, (words, help_text)


def test_a_search_budget_or_bits_that_do_not_parse_are_one_line_naming_the_flag(tmp_path):
    model_dir = tiny_model_dir(tmp_path)
    data = f"parquet:{token_parquet(tmp_path / 'data.parquet', rows=12, seq_len=32)}"
    for flag, value, message in [
        ("--max-ppl-rise", "abc", "invalid option: --max-ppl-rise takes 1% or 0.01, got 'abc'"),
        ("--bits", "3,x", "invalid option: --bits takes e.g. 3,4,dense, got '3,x'"),
    ]:
        res = _lrkv(["search", "--model", str(model_dir), "--dataset", data, flag, value], tmp_path / "home")
        output = res.stdout + res.stderr
        assert res.returncode == 2, output[-2000:]
        assert f"error: {message}" in " ".join(output.split()), output[-2000:]
        assert "Traceback" not in output


def test_a_list_of_numbers_that_does_not_parse_is_one_line_naming_the_flag_and_the_item(
    tmp_path, monkeypatch
):
    from typer.testing import CliRunner

    from lrkv_flows.cli import app

    monkeypatch.setenv("LRKV_HOME", str(tmp_path / "home"))
    model = ["--model", str(tiny_model_dir(tmp_path))]
    for args, message in [
        (["search", *model, "--ratios", "0.5,x"], "--ratios takes a comma list of numbers, got 'x'"),
        (["ablate", *model, "--ratios", "0.5,,x"], "--ratios takes a comma list of numbers, got 'x'"),
        (
            ["ablate", *model, "--group-sizes", "2,y"],
            "--group-sizes takes a positive integer or 'auto', got 'y'",
        ),
        (["bench", *model, "--contexts", "64,1e3"], "--contexts takes a comma list of integers, got '1e3'"),
        (["bench", *model, "--bits", "3,4.5"], "--bits takes a comma list of integers, got '4.5'"),
    ]:
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 2 and res.exception is None or isinstance(res.exception, SystemExit), (
            res.output
        )
        assert " ".join(res.output.split()) == f"error: invalid option: {message}", (args, res.output)
    assert not (tmp_path / "home").exists()  # refused before any set-up
