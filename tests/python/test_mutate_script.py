"""scripts/mutate.py's list of planted bugs still applies to the source: each
mutation's old text occurs exactly once in its file, and the tests it names
exist. Nothing is mutated or built here (the script itself runs before a
release, not in CI); this keeps its list from rotting silently as the code
it points into changes."""
import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_mutate():
    spec = importlib.util.spec_from_file_location("tidal_mutate_script", ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


mutate = load_mutate()


def test_the_list_holds_the_bugs_the_suite_once_missed_and_names_are_unique():
    names = [m.name for m in mutate.MUTATIONS]
    assert len(names) == len(set(names)), names
    # bias correction's step count, the clip factor's cap, the checkpoint's
    # CRC check, the eviction choice, DTR's RNG replay (issue 46).
    assert {"bias-correction-step", "clip-cap", "checkpoint-crc", "eviction-soonest",
            "dtr-rng-replay"} <= set(names)
    assert any(m.native for m in mutate.MUTATIONS) and any(not m.native for m in mutate.MUTATIONS)


@pytest.mark.parametrize("mutation", mutate.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_applies_once_to_the_current_source(mutation):
    text = mutate.check(mutation, ROOT)  # raises unless the old text occurs exactly once
    mutated = text.replace(mutation.old, mutation.new)
    assert mutated != text
    if mutation.path.endswith(".py"):
        ast.parse(mutated)  # a planted bug, not a syntax error


@pytest.mark.parametrize("mutation", mutate.MUTATIONS, ids=lambda m: m.name)
def test_each_mutation_names_tests_that_exist(mutation):
    assert mutation.tests
    for node in mutation.tests:
        path, _, func = node.partition("::")
        source = ROOT / path
        assert source.is_file(), node
        if func:
            assert f"\ndef {func}(" in source.read_text(), node


def test_check_refuses_text_that_is_missing_or_repeated(tmp_path):
    (tmp_path / "f.py").write_text("a = 1\nb = 1\n")
    once = mutate.Mutation("x", "f.py", "a = 1", "a = 2", ("t",), "")
    assert mutate.check(once, tmp_path) == "a = 1\nb = 1\n"
    for old in ("c = 1", " = 1"):
        with pytest.raises(ValueError, match="found it [02] times"):
            mutate.check(mutate.Mutation("x", "f.py", old, "z", ("t",), ""), tmp_path)


def test_the_work_copy_is_never_the_checkout():
    with pytest.raises(SystemExit, match="inside the checkout"):
        mutate.Copy(ROOT / "build" / "mutate-work")
    with pytest.raises(SystemExit, match="inside the checkout"):
        mutate.Copy(ROOT)
