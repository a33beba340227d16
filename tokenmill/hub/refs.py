"""How a user names a model on the Hugging Face Hub, and which of a repo's files that name means.

The forms other engines take, so that a copied id works as it is: ``ORG/NAME`` (vLLM, TGI),
``ORG/NAME:QUANT`` (llama.cpp's ``-hf``), ``hf.co/ORG/NAME:QUANT`` (Ollama) and the Hub's page
address. Pure string logic (no network, no files): the choice of files is made the same way
from the Hub's listing when online and from the cached snapshot when offline.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tokenmill.errors import ModelLoadError

_PREFIXES = ("https://huggingface.co/", "http://huggingface.co/", "huggingface.co/", "hf.co/")
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?"  # the Hub's rule for a user, org or repo name
_REF = re.compile(rf"({_NAME}/{_NAME})(?::([A-Za-z0-9._-]+))?")

DEFAULT_GGUF_QUANT = "Q4_K_M"  # llama.cpp's -hf and Ollama take this one when no tag is given
# A quant type in a GGUF file's name: Q4_K_M, q8_0, IQ4_XS, F16, BF16, ... (the name's last such part).
_QUANT = re.compile(
    r"(?i)(?<![A-Za-z0-9])(I?Q[1-8](?:_[0-9A-Z]+)*|T?Q[0-9]_[0-9]|BF16|F16|F32|FP16|FP32|MXFP4)(?![A-Za-z0-9])"
)
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
# Of a safetensors repo, what the loader reads; never other formats' weights (.bin, .pth, ONNX, GGUF) or subfolders.
_HF_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "quantize_config.json",
    "adapter_config.json",
)


@dataclass(frozen=True)
class HubRef:
    """A repo id and, for a GGUF repo, the quant tag (None: the default choice)."""

    repo_id: str
    tag: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f":{self.tag}" if self.tag else "")


def parse_ref(text: str) -> HubRef | None:
    """The Hub repo a model argument names, or None when it is not in a repo id's form."""
    for prefix in _PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix) :]
            break
    text = text.rstrip("/")
    m = _REF.fullmatch(text)
    if m is None or ".." in m.group(1) or "--" in m.group(1):  # the Hub allows neither in an id
        return None
    tag = m.group(2)
    return HubRef(m.group(1), None if tag is None or tag.lower() == "latest" else tag)


@dataclass(frozen=True)
class ModelFiles:
    """The files of a repo that make the model, and what the loader is given."""

    kind: str  # "safetensors", "gguf" or "adapter" (a LoRA adapter's folder)
    files: tuple[str, ...]  # repo paths to have in the snapshot
    entry: str  # the repo path to load: "" for the folder, else a GGUF file (a split model's first part)
    quant: str | None = None  # a GGUF's tag


def gguf_quant(filename: str) -> str | None:
    """The quant tag in a GGUF file's name (upper case), or None."""
    base = _SPLIT.sub(".gguf", filename.rsplit("/", 1)[-1])
    found = _QUANT.findall(base.removesuffix(".gguf"))
    return found[-1].upper() if found else None


def gguf_choices(names: Iterable[str]) -> dict[str, list[str]]:
    """Each quant tag of a repo's GGUF files and its files (a split model's parts in order);
    multimodal projectors (mmproj) are not models."""
    out: dict[str, list[str]] = {}
    for name in sorted(names):
        base = name.rsplit("/", 1)[-1].lower()
        if not base.endswith(".gguf") or base.startswith("mmproj") or "-mmproj" in base:
            continue
        out.setdefault(gguf_quant(name) or base.removesuffix(".gguf").upper(), []).append(name)
    return out


def choose_files(
    ref: HubRef, names: Iterable[str], read_json: Callable[[str], dict] | None = None, where: str = "the Hub"
) -> ModelFiles:
    """The files ``ref`` means among a repo's (or a cached snapshot's) ``names``. A safetensors
    model's shards come from its index when ``read_json`` can read it, else every root
    ``model*.safetensors`` is taken; a GGUF is chosen by tag; a LoRA adapter is its two files."""
    names = sorted(names)
    root = [n for n in names if "/" not in n]
    safetensors = [n for n in root if n.endswith(".safetensors")]
    ggufs = gguf_choices(names)
    if ref.tag is not None or (ggufs and not safetensors):
        return _choose_gguf(ref, ggufs, where)
    if "adapter_config.json" in root and "config.json" not in root:
        weights = [n for n in root if n == "adapter_model.safetensors"]
        if not weights:
            raise ModelLoadError(f"{ref.repo_id} on {where} is a LoRA adapter without adapter_model.safetensors")
        return ModelFiles("adapter", ("adapter_config.json", *weights), "")
    if not safetensors:
        held = ", ".join(sorted({n.rsplit(".", 1)[-1] for n in root if "." in n})) or "nothing"
        raise ModelLoadError(
            f"{ref.repo_id} on {where} holds no safetensors or GGUF weights (its files: {held}); "
            "tokenmill reads safetensors and GGUF, never pickled .bin/.pth weights, which run code when loaded"
        )
    if "config.json" not in root:
        raise ModelLoadError(f"{ref.repo_id} on {where} has safetensors weights but no config.json")
    index = "model.safetensors.index.json"
    weights = [n for n in safetensors if n == "model.safetensors" or re.fullmatch(r"model-\d+-of-\d+\.safetensors", n)]
    mapped = read_json(index).get("weight_map", {}) if index in root and read_json is not None else {}
    if isinstance(mapped, dict) and mapped:
        weights = sorted(set(mapped.values()))
    elif not weights:
        weights = safetensors
    extra = [index] if index in root else []
    return ModelFiles("safetensors", (*[n for n in _HF_FILES if n in root], *extra, *weights), "")


def _choose_gguf(ref: HubRef, ggufs: dict[str, list[str]], where: str) -> ModelFiles:
    if not ggufs:
        raise ModelLoadError(f"{ref} names a GGUF quant, but {ref.repo_id} on {where} has no GGUF files")
    tags = ", ".join(sorted(ggufs))
    if ref.tag is not None:
        tag = ref.tag.upper()
        if tag not in ggufs:
            raise ModelLoadError(f"{ref.repo_id} on {where} has no {ref.tag} GGUF; its tags: {tags}")
    elif DEFAULT_GGUF_QUANT in ggufs:
        tag = DEFAULT_GGUF_QUANT
    elif len(ggufs) == 1:
        tag = next(iter(ggufs))
    else:
        raise ModelLoadError(
            f"{ref.repo_id} on {where} has no {DEFAULT_GGUF_QUANT} GGUF, the default: name one of its tags "
            f"as {ref.repo_id}:TAG ({tags})"
        )
    files = ggufs[tag]
    parts = [_SPLIT.search(f) for f in files]
    if any(parts):
        count = int(parts[0].group(2)) if parts[0] else 0
        numbers = sorted(int(p.group(1)) for p in parts if p)
        if not all(parts) or numbers != list(range(1, count + 1)):
            raise ModelLoadError(
                f"{ref.repo_id} on {where}: the {tag} GGUF's split parts are incomplete ({', '.join(files)})"
            )
    return ModelFiles("gguf", tuple(files), files[0], tag)
