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
