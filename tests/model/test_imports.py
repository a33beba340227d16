"""Import direction: the engine's bookkeeping and the CLI's parser load without torch
(the package's names load on first use), so `tokenmill --help` answers at once and an
engine-core process could start without the model stack."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_engine_modules_import_without_torch():
    loaded = _modules_after(
        "import tokenmill.engine.engine, tokenmill.engine.async_engine, tokenmill.engine.core.runner_sync"
    )
    assert "tokenmill.engine.core.scheduler" in loaded and "torch" not in loaded


def test_the_api_process_of_serve_imports_without_torch():
    """Its tokenizer, app and engine client load no model stack: torch lives in the
    engine-core process only."""
    loaded = _modules_after(
        "import tokenmill.entrypoints.launch, tokenmill.engine.api.core_client, tokenmill.engine.core.core_loop, tokenmill.core_process\n"
        "from tokenmill.model.paths import resolve_model_path\nfrom tokenmill.model.tokenizer import load_tokenizer\n"
        "tok = load_tokenizer(resolve_model_path(None))\nassert tok.encode('hello')"
    )
    assert "tokenmill.engine.pipe.wire" in loaded and "torch" not in loaded


def test_cli_help_imports_without_torch():
    loaded = _modules_after(
        "import sys\nfrom tokenmill.entrypoints.cli import main\nsys.argv = ['tokenmill', '--help']\n"
        "try:\n    main()\nexcept SystemExit:\n    pass"
    )
    assert "tokenmill.entrypoints.cli" in loaded and "torch" not in loaded


def test_package_names_load_on_first_use():
    loaded = _modules_after("import tokenmill\nassert tokenmill.SamplingParams(max_tokens=3).max_tokens == 3")
    assert "torch" not in loaded
    assert "torch" in _modules_after("import tokenmill\ntokenmill.LLM")
