"""torch.compile's cache, carried by the checkpoints: a restart on a node that never compiled the model does not
compile it from scratch.

Inductor caches what it compiled on the node's disk (TORCHINDUCTOR_CACHE_DIR): a worker restarted on the same node
finds it, one on a fresh node (a spot replacement) does not and compiles again — minutes for BERT-Large on a GPU.
PyTorch's portable cache artifacts ("mega-cache": torch.compiler.save_cache_artifacts) are everything this process
compiled (inductor's graphs, AOTAutograd's, autotuning; on a GPU the Triton kernels bundled in) as one blob;
load_cache_artifacts puts them into the local caches, so the next compile of the same graphs on the same software
is a cache hit. On a CPU the graphs' C++ kernels are not in it: a hit still builds each one with the C++ compiler,
which is most of a CPU compile (the tiny model: 32.7 s with the artifacts loaded, 34.7 s cold), so the kernels
this process loaded go along (`*.so`, by their place in the cache directory: inductor builds a kernel only when its
file is missing; the file's name hashes its source and compiler command, so a node of another build never picks
up a foreign one). So do the small libraries inductor builds once per process to learn which vector instructions
the compiler takes (its ISA probes: 4 builds, ~13 s of a warm start on this machine's cores, left out they are
built again on every fresh node; which instructions the CPU has is still read from the CPU). The kernels are
native code loaded as they come: the checkpoints' storage is trusted as it is for their pickles.

Rank 0 writes both into every checkpoint it saves (CACHE_FILE, a zip: every rank compiles the same graphs), the
artifacts serialized again only when the process compiled (or hit its cache) since; every worker of a resumed
attempt reads it before its first compiled step.

The file carries its own SHA-256: one cut short by a crash mid-upload, or written by another PyTorch, is passed
over with a line in the worker's log, and the model compiles as it would have without it. A checkpoint without
the file is complete all the same (checkpointing/folders.py): the cache only saves time.
"""
from __future__ import annotations

import glob
import hashlib
import io
import logging
import os
import tempfile
import zipfile

import torch

log = logging.getLogger("bertpipe.pretrain")

CACHE_FILE = "compile_cache.bin"
ARTIFACTS, KERNELS = "artifacts.bin", "kernels"  # its members: the mega-cache blob, the C++ kernels
# The header: what wrote it (a blob of another PyTorch is of no use: its cache keys differ) and the payload's hash.
MAGIC = b"bertpipe-compile-cache\n"
# A folder: each worker process compiles into a new, empty cache directory in it (fresh_cache_dir_if_asked).
FRESH_CACHE_ENV = "BERTPIPE_FRESH_COMPILE_CACHE"


def _compiled_since_serialized() -> bool:
    """PyTorch recorded cache artifacts (a compile, or a cache hit) since the last serialization."""
    from torch.compiler._cache import CacheArtifactManager

    return CacheArtifactManager.need_serialize()


def _loaded_kernels() -> dict[str, str]:
    """{path relative to the inductor cache directory: absolute path} of the C++ kernels this process loaded."""
    from torch._inductor.codecache import CppCodeCache, CppPythonBindingsCodeCache, CppWrapperCodeCache
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = cache_dir()
    found = {}
    for cls in (CppCodeCache, CppPythonBindingsCodeCache, CppWrapperCodeCache):
        for key in list(cls.cache):
            for path in glob.glob(os.path.join(root, key[1:3], f"{glob.escape(key)}*.so")):
                found[os.path.relpath(path, root)] = path
    return found


def _isa_probes(root: str) -> dict[str, str]:
    """{path relative to `root`: absolute path} of inductor's ISA probe libraries built in the cache directory `root`
    (torch._inductor.cpu_vec_isa: each a few lines of C++ whose symbols end in `_chk_kernel`, built by file name as
    the kernels are, but loaded in a child process, so in no cache this process keeps)."""
    found = {}
    for source in glob.glob(os.path.join(glob.escape(root), "*", "c*.cpp")):
        library = source[:-len(".cpp")] + ".so"
        if source.endswith(".main.cpp") or os.path.getsize(source) > 4096 or not os.path.isfile(library):
            continue
        with open(source, encoding="utf-8", errors="replace") as f:
            if "_chk_kernel" in f.read():
                found[os.path.relpath(library, root)] = library
    return found


class CompileCache:
    """One worker's view of the cache: what it loaded, and what it has to save."""

    def __init__(self) -> None:
        self._blob: bytes | None = None  # the last serialized (PyTorch's serialization appends: it holds all)
        self._zipped: tuple[tuple, bytes] | None = None  # (what it holds, the zip): made again when that changes
        self._probes: dict[str, str] | None = None  # inductor's ISA probes, looked up once: built at the first compile
        self.loaded = False  # this attempt started from a checkpoint's cache
        self.load_s = 0.0  # what reading and loading it took

    def artifacts(self) -> bytes | None:
        """The serialized artifacts of everything compiled in this process so far (None: nothing compiled)."""
        if self._blob is None or _compiled_since_serialized():
            saved = torch.compiler.save_cache_artifacts()
            if saved is not None and saved[0]:
                self._blob = saved[0]
        return self._blob

    def write(self, folder: str) -> bool:
        """The artifacts and kernels into the checkpoint `folder` (a local one, uploaded whole with the rest), under a
        temporary name first; False when there are none."""
        blob = self.artifacts()
        if not blob:
            return False
        if self._probes is None:  # (the cache directory is scanned once per process, not at every checkpoint)
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            self._probes = _isa_probes(cache_dir())
        kernels = sorted({**self._probes, **_loaded_kernels()}.items())
        holds = (len(blob), hashlib.sha256(blob).digest(), tuple(rel for rel, _ in kernels))
        if self._zipped is None or self._zipped[0] != holds:
            payload = io.BytesIO()
            with zipfile.ZipFile(payload, "w", zipfile.ZIP_STORED) as z:  # (.so files and pickles barely compress)
                z.writestr(ARTIFACTS, blob)
                for rel, path in kernels:
                    z.write(path, f"{KERNELS}/{rel}")
            self._zipped = (holds, payload.getvalue())
        body = self._zipped[1]
        header = MAGIC + torch.__version__.encode() + b"\n" + hashlib.sha256(body).hexdigest().encode() + b"\n"
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{CACHE_FILE}.")
        with os.fdopen(fd, "wb") as f:
            f.write(header + body)
        os.replace(tmp, os.path.join(folder, CACHE_FILE))
        return True

    def read(self, folder: str) -> bool:
        """The checkpoint `folder`'s cache loaded into this process's (its kernels into the inductor cache directory,
        where missing), before its first compile; False (and the reason in the log) when it has none or none this
        PyTorch can use."""
        import time

        from torch._inductor.runtime.cache_dir_utils import cache_dir

        started = time.perf_counter()
        try:
            body = _payload(os.path.join(folder, CACHE_FILE))
            if body is not None:
                with zipfile.ZipFile(io.BytesIO(body)) as z:
                    _unpack_kernels(z, cache_dir())
                    blob = z.read(ARTIFACTS)
                if torch.compiler.load_cache_artifacts(blob) is None:  # (PyTorch logs why it could not)
                    raise ValueError("PyTorch could not read its artifacts")
                self._blob, self.loaded = blob, True  # what a checkpoint saved before this process compiles carries
        except Exception as exc:  # noqa: BLE001 - a cache that cannot be loaded costs a compile, never the run
            log.info("the checkpoint's compile cache could not be loaded (%s): compiling from scratch", exc)
        self.load_s = time.perf_counter() - started
        return self.loaded


def _unpack_kernels(z: zipfile.ZipFile, root: str) -> None:
    """The zip's kernels into the cache directory `root`, each written whole under a temporary name first (another
    worker of the node may be loading the same one); those already there are kept."""
    for name in z.namelist():
        rel = name[len(KERNELS) + 1:]
        if not name.startswith(KERNELS + "/") or not rel.endswith(".so") or os.path.isabs(rel) or ".." in rel:
            continue
        target = os.path.join(root, rel)
        if os.path.exists(target):
            continue
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".kernel.")
        with os.fdopen(fd, "wb") as f:
            f.write(z.read(name))
        os.replace(tmp, target)


def _payload(path: str) -> bytes | None:
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        raw = f.read()
    magic, _, rest = raw.partition(b"\n")
    version, _, rest = rest.partition(b"\n")
    digest, _, blob = rest.partition(b"\n")
    if magic + b"\n" != MAGIC:
        raise ValueError(f"{path} is not a compile cache")
    if version.decode() != torch.__version__:
        raise ValueError(f"written by PyTorch {version.decode()}, this is {torch.__version__}")
    if hashlib.sha256(blob).hexdigest().encode() != digest:
        raise ValueError(f"{path} is cut short or damaged")
    return blob


def fresh_cache_dir_if_asked() -> str:
    """With FRESH_CACHE_ENV set to a folder, this process's inductor cache goes to a new empty directory in it: a
    worker starts as on a node that never compiled (how the tests and benchmarks/README.md measure a fresh node on
    one machine). Returns the directory ("" when not asked)."""
    parent = os.environ.get(FRESH_CACHE_ENV, "")
    if not parent:
        return ""
    os.makedirs(parent, exist_ok=True)
    folder = tempfile.mkdtemp(prefix="inductor-", dir=parent)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = folder
    return folder
