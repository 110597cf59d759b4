"""gti.common.errors.user_error: the one unwrapping of Ray's exception wrappers (no Ray cluster needed:
Ray's exception classes are built directly, as Ray builds them on the driver)."""

from __future__ import annotations

import pickle

import pytest

from gti.common.errors import ConfigError, DataError, GtiError, UnreadableFileError, one_line, user_error

ANSI_PROCTITLE = "\x1b[36mray::MapBatches(_read_validate)()\x1b[39m (pid=123, ip=10.0.0.1)"


def test_plain_and_chained_errors():
    e = DataError("x.csv: missing column 'id'")
    assert user_error(e) is e
    try:
        try:
            raise e
        except DataError as inner:
            raise RuntimeError("wrapper") from inner
    except RuntimeError as outer:
        assert user_error(outer) is e
    assert user_error(RuntimeError("a bug")) is None
    assert user_error(ValueError("gti is mentioned but no error line")) is None


def test_ray_task_error_with_the_cause_object():
    from ray.exceptions import RayTaskError

    cause = UnreadableFileError("/d/part-1.parquet", "row group 2: Couldn't deserialize thrift")
    err = RayTaskError("MapBatches(_read_validate)", "Traceback ...", cause, ANSI_PROCTITLE, 123, "10.0.0.1")
    wrapped = err.as_instanceof_cause()
    got = user_error(wrapped)
    assert got is cause and isinstance(got, UnreadableFileError) and got.file == "/d/part-1.parquet"


def test_ray_data_user_code_exception_keeps_only_text():
    """Ray Data raises UserCodeException from the UDF's error; only the traceback text crosses
    the process boundary. The message comes back without Ray's ANSI colour codes."""
    from ray.exceptions import RayTaskError, UserCodeException

    tb = ("Traceback (most recent call last):\n  File \"adapters.py\", line 9\n"
          "gti.common.errors.UnreadableFileError: /d/b.csv.gz: cannot read: Truncated compressed stream\n\n"
          "The above exception was the direct cause of the following exception:\n\n"
          f"{ANSI_PROCTITLE}\nray.exceptions.UserCodeException: UDF failed to process a data block.")
    err = RayTaskError("MapBatches(_read_validate)", tb, UserCodeException("UDF failed"), ANSI_PROCTITLE,
                       123, "10.0.0.1").as_instanceof_cause()
    got = user_error(err)
    assert isinstance(got, DataError)
    assert str(got) == "/d/b.csv.gz: cannot read: Truncated compressed stream"
    # Other user errors (config, gates) come back as GtiError with their message.
    cfg = RayTaskError("f", "x\ngti.common.errors.ConfigError: eval.ks: too large\n", RuntimeError("x"), "p", 1, "i")
    got = user_error(cfg)
    assert type(got) is GtiError and str(got) == "eval.ks: too large"


def test_ray_train_worker_failures():
    class TrainingFailed(Exception):  # the shape of Ray Train V2's error: rank -> exception
        def __init__(self, failures):
            super().__init__("Training failed")
            self.worker_failures = failures

    bad = ConfigError("sft.steps: must be > 0")
    assert user_error(TrainingFailed({0: RuntimeError("peer died"), 1: bad})) is bad
    assert user_error(TrainingFailed({0: RuntimeError("oom")})) is None


def test_unreadable_file_error_pickles_with_its_fields():
    e = pickle.loads(pickle.dumps(UnreadableFileError("s3://b/k.jsonl.gz", "cannot read after line 7: x")))
    assert (e.file, e.what, str(e)) == ("s3://b/k.jsonl.gz", "cannot read after line 7: x",
                                       "s3://b/k.jsonl.gz: cannot read after line 7: x")


@pytest.mark.parametrize("text,want", [
    ("\x1b[31mboom\x1b[0m\nmore", "boom"),
    ("\n\n  second  \n", "second"),
    ("", ""),
])
def test_one_line(text, want):
    assert one_line(text) == want


def test_a_bug_while_handling_a_user_error_stays_a_bug():
    try:
        try:
            raise DataError("x.csv: bad")
        except DataError:
            {}["missing"]  # a bug in the handler: implicit context, not `from`
    except KeyError as bug:
        assert user_error(bug) is None
