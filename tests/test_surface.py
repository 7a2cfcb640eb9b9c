"""The public surface: what ``from te_serial import *`` brings, and that it shadows no builtin."""

import builtins

import te_serial as ts


def test_star_import_exports_only_real_names_and_shadows_no_builtin():
    ns: dict = {}
    exec("from te_serial import *", ns)
    exported = set(ns) - {"__builtins__"}
    assert exported == set(ts.__all__)
    assert not exported & set(dir(builtins)), exported & set(dir(builtins))
    assert callable(ts.open) and ts.open.__name__ == "open_checkpoint"   # still reachable by name
    assert "export_tensors" in ts.__all__ and ts.export_tensors.__module__ == "te_serial.serving"


def test_the_readme_example_runs(tmp_path, monkeypatch):
    """The README's one example, as a newcomer pastes it (in an empty directory)."""
    import re
    from pathlib import Path
    text = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    code = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - our own documentation
    assert ns["rows"].shape == (128, 256) and ns["proto"].shape == (512, 256)
    assert (tmp_path / "served" / "config.json").is_file()


def test_the_public_modules_are_the_ones_the_readme_lists():
    """``__all__`` only where a module is public, and every public module is the README's list."""
    import importlib
    import pkgutil
    import re
    from pathlib import Path
    text = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    sentence = re.search(r"The public modules are (.*?)\.\n\n", text, re.S).group(1)
    documented = set(re.findall(r"`(te_serial(?:\.\w+)*)`", sentence))
    declaring = {"te_serial"}
    for info in pkgutil.walk_packages(ts.__path__, "te_serial."):
        if info.name.startswith("te_serial.native") or ".tests" in info.name:
            continue
        module = importlib.import_module(info.name)
        if "__all__" in vars(module):
            declaring.add(info.name)
    assert declaring <= documented, declaring - documented
    for name in documented:
        importlib.import_module(name)
    from te_serial import errors
    classes = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, BaseException)]
    assert all(issubclass(c, errors.TeSerialError) for c in classes)  # one hierarchy


def test_the_readme_commands_and_ci_runs_them_as_written():
    """The README's first command installs te-serial alone (torch pinned by constraints.txt) and runs
    the demo, no serving engine; the second installs the test extra and the consumer tests' engines
    and runs the tests; ``.ci/run`` runs exactly these two lines, in that order."""
    import re
    import subprocess
    from pathlib import Path
    root = Path(__file__).parents[1]
    block = re.search(r"```bash\n(.*?)```", (root / "README.md").read_text(encoding="utf-8"), re.S).group(1)
    first, second = [line for line in block.splitlines() if line.strip()]
    steps = [s.strip() for s in first.split("&&")]
    assert steps[0] == "pip install -c constraints.txt torch==2.13.0" and steps[-1] == "te-serial demo", steps
    assert all(s.startswith("pip install -c constraints.txt") for s in steps[:-1]), steps
    assert not any(word in first for word in ("[test]", "consumers", "vllm", "sglang")), first
    steps = [s.strip() for s in second.split("&&")]
    assert steps == ['pip install -c constraints.txt -e ".[test]"',
                     "pip install --no-deps -c constraints.txt -r tests/consumers/requirements.txt",
                     "python -m pytest -q"], steps
    assert "torch==2.13.0" in (root / "constraints.txt").read_text(encoding="utf-8").split()
    ci = subprocess.run([str(root / ".ci" / "run"), "--dry-run"], capture_output=True, text=True, check=True)
    assert ci.stdout.splitlines() == [first, second], ci.stdout
