"""Every name kiln's code uses resolves (pyflakes), and every import of its own names
finds them: much of the worker runs only on MLX's CUDA backend, which CI does not have,
so a name left behind by a move (session 29 split worker_proc/paged_attention.py) would
otherwise first fail on the device."""

from __future__ import annotations

from pathlib import Path

from pyflakes import api, messages, reporter

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("launch.py", "ipc", "kiln_common", "tokenizer_proc", "scheduler_proc",
           "worker_proc", "detokenizer_proc", "bench", "tests")
UNRESOLVED = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport,
              messages.ImportStarUsage)


class _Collect(reporter.Reporter):
    def __init__(self) -> None:
        super().__init__(None, None)
        self.found: list[str] = []

    def flake(self, message: messages.Message) -> None:
        if isinstance(message, UNRESOLVED):
            self.found.append(str(message))

    def syntaxError(self, filename, msg, lineno, offset, text) -> None:  # noqa: ANN001, N802
        self.found.append(f"{filename}:{lineno}: {msg}")

    def unexpectedError(self, filename, msg) -> None:  # noqa: ANN001, N802
        self.found.append(f"{filename}: {msg}")


def test_every_name_in_kiln_resolves():
    collect = _Collect()
    files = [p for name in CHECKED for p in
             ([ROOT / name] if name.endswith(".py") else sorted((ROOT / name).rglob("*.py")))]
    assert len(files) > 100
    for path in files:
        api.checkPath(str(path), collect)
    assert not collect.found, "\n".join(collect.found)


def test_every_import_of_kiln_names_finds_them():
    """Imports of kiln's own modules' names, function-local ones in CUDA-only code too,
    name something that module defines (pyflakes does not follow imports)."""
    import ast
    import importlib

    packages = {name for name in CHECKED if not name.endswith(".py")}
    missing = []
    for path in (p for name in CHECKED if not name.endswith(".py")
                 for p in sorted((ROOT / name).rglob("*.py"))):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                    and node.module.split(".")[0] in packages):
                module = importlib.import_module(node.module)
                missing += [f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{a.name}"
                            for a in node.names
                            if not hasattr(module, a.name)
                            and not _is_submodule(node.module, a.name)]
    assert not missing, "\n".join(missing)


def _is_submodule(package: str, name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(f"{package}.{name}") is not None
