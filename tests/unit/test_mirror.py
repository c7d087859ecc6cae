"""tests/ mirrors rl/: every subpackage of rl/ has its folder of unit tests (tests/unit/<subpackage>/, at least one
test file), so a contributor finds a module's tests where the module is. The launch code (rl/scripts) runs in
subprocesses and is tested end to end in tests/integration/."""

from __future__ import annotations

from tests.conftest import ROOT

END_TO_END = {"scripts"}  # tested through the launch scripts, in tests/integration/


def test_every_subpackage_has_its_unit_test_folder():
    subpackages = sorted(p.name for p in (ROOT / "rl").iterdir() if (p / "__init__.py").exists())
    assert len(subpackages) >= 10, subpackages  # the walk found the package
    missing = [name for name in subpackages if name not in END_TO_END
               and not list((ROOT / "tests" / "unit" / name).glob("test_*.py"))]
    assert not missing, f"rl/{missing[0]}/ has no tests/unit/{missing[0]}/test_*.py"
    assert list((ROOT / "tests" / "integration").glob("test_*.py"))
