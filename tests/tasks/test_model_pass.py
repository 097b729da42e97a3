import threading

import pytest

from lrkv_tasks import device
from lrkv_tasks.recipes.convert_recipe import CalibrationRecipe


@pytest.fixture
def slots(monkeypatch):
    def reset(value=None):
        if value is None:
            monkeypatch.delenv(device.PASSES_ENV, raising=False)
        else:
            monkeypatch.setenv(device.PASSES_ENV, value)
        monkeypatch.setattr(device, "_PASSES", None)

    return reset


def _most_at_once(n_threads: int) -> int:
    inside, most, lock = [0], [0], threading.Lock()
    go = threading.Barrier(n_threads)

    def work():
        go.wait()
        with device.model_pass():
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            threading.Event().wait(0.05)
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=work) for _ in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return most[0]


def test_whole_model_passes_take_turns_by_default(slots):
    slots()
    assert _most_at_once(4) == 1


def test_the_environment_allows_more_passes_at_once(slots):
    slots("2")
    assert _most_at_once(4) == 2


@pytest.mark.parametrize("value", ["0", "two"])
def test_a_bad_limit_is_refused_in_one_line(slots, value):
    slots(value)
    with pytest.raises(ValueError, match="LRKV_MODEL_PASSES must be a whole number ≥ 1"), device.model_pass():
        pass


@pytest.mark.parametrize(
    ("seq_len", "batch_size", "batch_tokens", "rows"),
    [(256, 8, 2048, 8), (512, 8, 2048, 4), (2048, 8, 2048, 1), (8192, 8, 2048, 1), (256, 2, 2048, 2)],
)
def test_rows_per_pass_keep_a_pass_within_its_tokens(seq_len, batch_size, batch_tokens, rows):
    cal = CalibrationRecipe(seq_len=seq_len, batch_size=batch_size, batch_tokens=batch_tokens)
    assert cal.rows_per_pass == rows


def test_by_default_a_pass_holds_one_row_of_256_tokens():
    assert CalibrationRecipe().rows_per_pass == 1


def test_the_wait_for_a_slot_is_noted_for_the_task_run_that_waited(slots, monkeypatch):
    slots()
    monkeypatch.setattr(device, "current_task_run_id", lambda: threading.current_thread().name)
    holding, done = threading.Event(), threading.Event()

    def first():
        with device.model_pass():
            holding.set()
            done.wait(5)

    def second():
        holding.wait(5)
        with device.model_pass():
            pass

    a, b = threading.Thread(target=first, name="a"), threading.Thread(target=second, name="b")
    a.start()
    b.start()
    threading.Event().wait(0.2)  # b is waiting for a's slot by now
    done.set()
    a.join()
    b.join()
    assert device.waited_seconds("a") == 0.0
    assert device.waited_seconds("b") >= 0.1
    assert device.waited_seconds("b") == 0.0  # read once


def test_a_bad_limit_stops_a_conversion_before_any_work(slots, tmp_path):
    from lrkv_tasks.recipes.convert_recipe import ConvertRecipe
    from lrkv_tasks.recipes.preflight import prepare
    from tests.support.models import tiny_model_dir

    slots("none")
    recipe = ConvertRecipe(model=str(tiny_model_dir(tmp_path)))
    with pytest.raises(ValueError, match="LRKV_MODEL_PASSES must be a whole number ≥ 1, got 'none'"):
        prepare(recipe)
