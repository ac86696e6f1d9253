"""The README states what the result files say, and names the commands CI runs."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_performance_table_is_generated_from_the_result_files():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "make_table.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/train.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
