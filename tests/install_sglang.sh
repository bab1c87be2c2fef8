#!/usr/bin/env bash
# Install SGLang 0.5.23 for the differential test (tests/integrations/test_vs_sglang.py) and the side-by-side
# benchmark (benchmarks/bench_vs_sglang.py), into the active Python environment. CI (.ci/run)
# and people both call this one script.
#
# SGLang pins versions that clash with ours (torch, transformers, ...), so it goes in without
# its dependencies, followed by only what its mem_cache package imports on a CPU-only machine
# (found by importing radix_cache, base_prefix_cache, unified_radix_cache and rust_tree_core
# until nothing was missing). Packages that would drag in another torch (triton, torchvision,
# compressed-tensors) are installed with --no-deps as well.
set -euo pipefail

PY=${PYTHON:-python}
SGLANG_VERSION=0.5.23

# torchvision must match the installed torch's ABI: torch 2.N pairs with torchvision 0.(N+15).
TORCHVISION=$("$PY" -c 'import torch; major, minor = torch.__version__.split(".")[:2]; print(f"torchvision==0.{int(minor) + 15}.*" if major == "2" else "torchvision")')

# Where SGLang 0.5.23 pins a version, the same pin (so a new release elsewhere cannot break
# the import); the rest as SGLang leaves them.
"$PY" -m pip install --quiet --no-deps "sglang==${SGLANG_VERSION}" triton==3.8.0 "${TORCHVISION}" \
    compressed-tensors==0.18.0
"$PY" -m pip install --quiet orjson psutil pybase64 requests pillow starlette msgspec pydantic \
    "pyzmq>=25.1.2" tqdm ipython aiohttp transformers==5.19.0 tokenizers==0.23.2 dill \
    apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 gguf openai==2.8.0 partial_json_parser loguru

# PyPI's torchvision wheels are built against CUDA torch: with a CPU-only torch their C ops
# do not load, and torchvision then registers fake kernels for ops that were never defined,
# which current torch refuses at import. SGLang only needs torchvision's Python side here:
# register those fake kernels only when the ops exist.
"$PY" - <<'PYFIX'
import importlib.util, pathlib, re
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
guarded = re.sub(r'^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)$',
                 r'@(torch.library.register_fake(\1) if torchvision.extension._has_ops() '
                 r'else (lambda fn: fn))', text, flags=re.M)
if guarded != text:
    path.write_text(guarded)
    print(f"torchvision: fake kernels registered only with its C ops ({path})")
PYFIX

"$PY" - <<'PYCHECK'
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: F401
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: F401
import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
from sglang.srt.managers.schedule_batch import Req  # noqa: F401
import sglang
print(f"sglang {sglang.__version__}: mem_cache imports")
PYCHECK
