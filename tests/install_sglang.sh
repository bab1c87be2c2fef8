#!/usr/bin/env bash
# Install SGLang 0.5.23 for the differential test (tests/test_vs_sglang.py) and the side-by-side
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
"$PY" -m pip install --quiet --no-deps "sglang==${SGLANG_VERSION}" triton "${TORCHVISION}" \
    compressed-tensors==0.18.0
"$PY" -m pip install --quiet orjson psutil pybase64 requests pillow starlette msgspec pydantic \
    "pyzmq>=25.1.2" tqdm ipython aiohttp transformers==5.19.0 tokenizers==0.23.2 dill \
    apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 gguf openai==2.8.0 partial_json_parser loguru

"$PY" - <<'PYCHECK'
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: F401
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams  # noqa: F401
import sglang.srt.mem_cache.unified_radix_cache  # noqa: F401
import sglang
print(f"sglang {sglang.__version__}: mem_cache imports")
PYCHECK
