"""scripts/run_tests.py (what `make test` runs): two pytest sessions side by side, each log printed
whole, and the exit status non-zero when either session failed."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _runner():
    spec = importlib.util.spec_from_file_location("run_tests", ROOT / "scripts" / "run_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_failure_in_either_session_fails_the_run_and_both_logs_are_printed(tmp_path, monkeypatch, capsys):
    run_tests = _runner()
    (tmp_path / "test_ok.py").write_text("def test_fine():\n    assert True\n")
    (tmp_path / "test_bad.py").write_text("def test_broken():\n    assert 1 == 2, 'the failure shows'\n")
    extra = ["-p", "no:cacheprovider"]
    monkeypatch.setattr(run_tests, "SESSIONS", {"first": [str(tmp_path / "test_ok.py")],
                                               "second": [str(tmp_path / "test_bad.py")]})
    assert run_tests.run_side_by_side(extra) == 1
    out = capsys.readouterr().out
    assert "===== first" in out and "===== second" in out and "the failure shows" in out
    assert "first: passed" in out and "second: FAILED (exit 1)" in out
    monkeypatch.setattr(run_tests, "SESSIONS", {"first": [str(tmp_path / "test_ok.py")],
                                               "again": [str(tmp_path / "test_ok.py")]})
    assert run_tests.run_side_by_side(extra) == 0


def test_progress_reads_how_far_pytest_has_come(tmp_path):
    run_tests = _runner()
    log = tmp_path / "s.log"
    assert run_tests.progress(log) == "starting"
    log.write_text("....F.")  # fewer tests than a line: no percentage yet
    assert run_tests.progress(log) == "6 tests"
    log.write_text("....  [ 12%]\n....  [ 40%]\n..")
    assert run_tests.progress(log) == "40% +2 tests"
