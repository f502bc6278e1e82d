"""llama.cpp for the --compare llamacpp peer: find (or build) its binaries, find its source, and
convert the bench checkpoint to GGUF once per quantization.

Binaries (`llama-batched-bench`, `llama-quantize`), first found wins:
  1. --llamacpp-dir DIR, else $NANOSERVE_LLAMACPP_DIR: a CMake build dir (DIR/bin/NAME) or a dir
     holding the binaries; when given and empty, llama.cpp is built into it;
  2. $NANOSERVE_CACHE/llama.cpp-build (default ~/.cache/nanoserve/llama.cpp-build), then
     /work/peers/llama.cpp-build (the shared build of this project's machines);
  3. the PATH.
  If none has them, they are built (about 10 min on 2 cores) into the dir of step 1, else of step 2,
  from llama.cpp's source.
Source (needed for convert_hf_to_gguf.py, and to build): --llamacpp-source, else
$NANOSERVE_LLAMACPP_SOURCE, else the source a found build was configured from (its CMakeCache.txt),
else a llama-cpp-python source package (`pip download --no-deps --no-binary :all:
llama-cpp-python==0.3.36`, which ships llama.cpp under vendor/llama.cpp) in the cache dir or /work/peers.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

from nanoserve.bench.peers import PeerUnavailable
from nanoserve.cache import cache_root

BINARIES = ("llama-batched-bench", "llama-quantize")
SHARED_ROOT = "/work/peers"  # where this project's machines keep the peers (PEERS.md)
SDIST_GLOB = "llama_cpp_python-*.tar.gz"
CONVERTER = "convert_hf_to_gguf.py"
CONVERT_WRAPPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_convert.py")
SOURCE_HINT = ("pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d ~/.cache/nanoserve "
               "(or pass --llamacpp-source PATH: that tarball, or a llama.cpp checkout)")
# The GGUF types compared, as llama-quantize names them; bf16 is the converter's output itself.
QUANTIZATIONS = ("bf16", "Q8_0", "Q4_K_M")
FINGERPRINT_FILE = "source.json"


def check_quantization(quant: str) -> None:
    if quant not in QUANTIZATIONS:
        raise ValueError(f"llama.cpp quantization must be one of {', '.join(QUANTIZATIONS)}, got {quant!r}")


def default_build_dirs(env: dict[str, str] | None = None) -> list[str]:
    """Where a build is looked for, in order (see the module docstring)."""
    env = os.environ if env is None else env
    dirs = [env["NANOSERVE_LLAMACPP_DIR"]] if env.get("NANOSERVE_LLAMACPP_DIR") else []
    return dirs + [os.path.join(cache_root(), "llama.cpp-build"), os.path.join(SHARED_ROOT, "llama.cpp-build")]


def binaries_in(directory: str) -> dict[str, str] | None:
    """{name: path} when `directory` (a CMake build dir, or a dir of binaries) has every binary."""
    for sub in ("bin", "", os.path.join("build", "bin")):
        paths = {name: os.path.join(directory, sub, name) for name in BINARIES}
        if all(os.access(p, os.X_OK) for p in paths.values()):
            return paths
    return None


def find_binaries(build_dir: str | None) -> tuple[dict[str, str] | None, str]:
    """(binaries or None, the dir to build into when None). `build_dir`: --llamacpp-dir, if given."""
    candidates = [build_dir] if build_dir else default_build_dirs()
    for directory in candidates:
        found = binaries_in(directory)
        if found:
            return found, directory
    if not build_dir:
        on_path = {name: shutil.which(name) for name in BINARIES}
        if all(on_path.values()):
            return on_path, os.path.dirname(on_path[BINARIES[0]])
    return None, candidates[0]


def _configured_source(build_dir: str) -> str | None:
    """The source dir a CMake build was configured from."""
    try:
        with open(os.path.join(build_dir, "CMakeCache.txt")) as f:
            for line in f:
                if line.startswith("CMAKE_HOME_DIRECTORY:"):
                    return line.split("=", 1)[1].strip()
    except OSError:
        pass
    return None


def llamacpp_root(path: str) -> str | None:
    """llama.cpp's source root inside `path`: a llama.cpp checkout, or llama-cpp-python's source
    (its vendor/llama.cpp), or a dir holding one extracted llama-cpp-python package."""
    for root in (path, os.path.join(path, "vendor", "llama.cpp"),
                 *sorted(glob.glob(os.path.join(path, "llama_cpp_python-*", "vendor", "llama.cpp")))):
        if os.path.isfile(os.path.join(root, CONVERTER)):
            return root
    return None


def _extract(tarball: str) -> str:
    """Unpack llama-cpp-python's source package once into the cache; returns llama.cpp's root."""
    dest = os.path.join(cache_root(), "llama.cpp-src", os.path.basename(tarball).removesuffix(".tar.gz"))
    root = llamacpp_root(dest)
    if root:
        return root
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=parent)
    try:
        with tarfile.open(tarball) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    root = llamacpp_root(dest)
    if root is None:
        raise PeerUnavailable(f"{tarball} holds no llama.cpp source ({CONVERTER} not found); {SOURCE_HINT}")
    return root


def resolve_source(path: str) -> str:
    """llama.cpp's root from --llamacpp-source: a source package tarball or a source dir."""
    if os.path.isfile(path) and path.endswith((".tar.gz", ".tgz")):
        return _extract(path)
    root = llamacpp_root(path) if os.path.isdir(path) else None
    if root is None:
        raise PeerUnavailable(f"--llamacpp-source {path}: not a llama.cpp source dir or llama-cpp-python source "
                              f"package ({CONVERTER} not found); {SOURCE_HINT}")
    return root


def find_source(source: str | None, build_dir: str | None) -> str:
    """llama.cpp's source root (see the module docstring for the order)."""
    source = source or os.environ.get("NANOSERVE_LLAMACPP_SOURCE")
    if source:
        return resolve_source(source)
    configured = _configured_source(build_dir) if build_dir else None
    if configured and llamacpp_root(configured):
        return llamacpp_root(configured)
    for parent in (cache_root(), SHARED_ROOT):
        for extracted in (os.path.join(parent, "llama.cpp-src"), os.path.join(parent, "llama.cpp-src", "*")):
            for d in sorted(glob.glob(extracted)):
                if llamacpp_root(d):
                    return llamacpp_root(d)
        tarballs = sorted(glob.glob(os.path.join(parent, SDIST_GLOB)))
        if tarballs:
            return _extract(tarballs[-1])
    raise PeerUnavailable(f"no llama.cpp source found; get llama-cpp-python's source package: {SOURCE_HINT}")


def cmake_commands(source: str, build_dir: str, jobs: int) -> list[list[str]]:
    """PEERS.md's build: native CPU flags, no network, Release, only the two tools."""
    return [["cmake", "-S", source, "-B", build_dir, "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
             "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF"],
            ["cmake", "--build", build_dir, f"-j{jobs}", "--target", *BINARIES]]


def build(source: str, build_dir: str, jobs: int) -> dict[str, str]:
    if shutil.which("cmake") is None:
        raise PeerUnavailable("cmake is not installed (apt-get install cmake g++), so llama.cpp cannot be built; "
                              "or pass --llamacpp-dir with a build")
    os.makedirs(build_dir, exist_ok=True)
    log_path = os.path.join(build_dir, "nanoserve-build.log")
    print(f"[llama.cpp] building {', '.join(BINARIES)} from {source} into {build_dir} (about 10 min on 2 cores; "
          f"log: {log_path}) ...", flush=True)
    with open(log_path, "w") as log:
        for cmd in cmake_commands(source, build_dir, jobs):
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0:
                raise PeerUnavailable(f"building llama.cpp failed ({' '.join(cmd)}); last lines of {log_path}:\n"
                                      + tail(log_path))
    found = binaries_in(build_dir)
    if found is None:
        raise PeerUnavailable(f"the llama.cpp build in {build_dir} finished without {', '.join(BINARIES)}")
    return found


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:]).rstrip()
    except OSError:
        return "(no log)"


# ---- GGUF conversion, cached beside the checkpoint ------------------------------------------

def gguf_dir(model: str) -> str:
    """The GGUF files of checkpoint `model` live in the sibling dir `<model>-gguf`."""
    return os.path.abspath(model).rstrip(os.sep) + "-gguf"


def gguf_path(model: str, quant: str) -> str:
    return os.path.join(gguf_dir(model), f"model-{quant}.gguf")


def checkpoint_fingerprint(model: str) -> dict:
    """What the GGUF files were made from: each checkpoint file's name, size and mtime, and the
    config's hash; a rebuilt checkpoint changes it, and its stale GGUF files are made again."""
    files = {}
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if os.path.isfile(path) and name.endswith((".safetensors", ".json", ".bin")):
            st = os.stat(path)
            files[name] = [st.st_size, int(st.st_mtime)]
    with open(os.path.join(model, "config.json"), "rb") as f:
        config_sha = hashlib.sha256(f.read()).hexdigest()
    return {"files": files, "config_sha256": config_sha}


def _cache_is_current(model: str) -> bool:
    try:
        with open(os.path.join(gguf_dir(model), FINGERPRINT_FILE)) as f:
            return json.load(f) == checkpoint_fingerprint(model)
    except (OSError, ValueError):
        return False


def partial_path(out: str) -> str:
    """Where a step writes before its output is renamed into place."""
    return out + ".partial"


def conversion_steps(model: str, quant: str, source: str, quantize_bin: str) -> list[tuple[str, list[str]]]:
    """(output file, command writing partial_path(output)) for each file `quant` still needs, in
    order: a cached, current file is skipped; a quantization first needs the bf16 file it is made from."""
    check_quantization(quant)
    current = _cache_is_current(model)
    bf16 = gguf_path(model, "bf16")
    steps = []
    if not (current and os.path.isfile(bf16)):
        steps.append((bf16, [sys.executable, CONVERT_WRAPPER, source, model, "--outtype", "bf16",
                             "--outfile", partial_path(bf16)]))
    out = gguf_path(model, quant)
    if quant != "bf16" and not (current and os.path.isfile(out)):
        steps.append((out, [quantize_bin, bf16, partial_path(out), quant]))
    return steps


def ensure_gguf(model: str, quant: str, source: str, quantize_bin: str) -> str:
    """gguf_path(model, quant), made unless a current one is cached; each file is written under a
    temporary name and renamed into place, so a crash never leaves a half-written file trusted."""
    steps = conversion_steps(model, quant, source, quantize_bin)
    out_dir = gguf_dir(model)
    if steps and not _cache_is_current(model) and os.path.isdir(out_dir):
        shutil.rmtree(out_dir)  # made from another build of the checkpoint
    for out, cmd in steps:
        os.makedirs(out_dir, exist_ok=True)
        print(f"[llama.cpp] making {out} ...", flush=True)
        log_path = os.path.join(out_dir, "convert.log")
        with open(log_path, "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=_converter_env()).returncode
        if rc != 0 or not os.path.isfile(partial_path(out)):
            raise PeerUnavailable(f"making {out} failed (status {rc}); last lines of {log_path}:\n{tail(log_path)}")
        os.replace(partial_path(out), out)
        with open(os.path.join(out_dir, FINGERPRINT_FILE), "w") as f:
            json.dump(checkpoint_fingerprint(model), f)
    return gguf_path(model, quant)


def _converter_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)  # the converter must use the gguf-py of its own source tree
    return env
