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
