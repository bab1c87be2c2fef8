"""Builds the two compiled modules; all metadata lives in pyproject.toml.

Both extensions are optional: where they cannot be built (no C compiler, or Cython missing
from a ``--no-build-isolation`` build), the build says so and the package installs with its
pure-Python modules, which ``radixcache/_core.py`` then picks.

With gcc or clang the modules are built without debug information, and on Linux linked
stripped (a sixth of the size); ``RADIXCACHE_DEBUG_SYMBOLS=1`` at build time keeps both, for
a debugger.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

# The C helpers both extensions include (radixcache/_include/*.h).
INCLUDE = ["radixcache/_include"]


class StrippedBuildExt(build_ext):
    """build_ext that compiles both modules at once (unless told ``-j``) and drops debug
    information where the compiler and linker take the flags."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:
            self.parallel = min(2, os.cpu_count() or 1)

    def build_extensions(self):
        # "unix": gcc or clang (Linux, macOS, the BSDs); MSVC writes debug info to a separate
        # .pdb file anyway. Only GNU-style linkers (Linux) take -s; macOS's ld ignores it.
        if self.compiler.compiler_type == "unix" and not os.environ.get(
                "RADIXCACHE_DEBUG_SYMBOLS"):
            for ext in self.extensions:
                ext.extra_compile_args.append("-g0")  # last: overrides Python's own -g
                if sys.platform.startswith("linux"):
                    ext.extra_link_args.append("-s")
        super().build_extensions()


def extensions():
    try:
        from Cython.Build import cythonize
    except ImportError:
        # pip's isolated build always installs Cython (pyproject.toml's build requirements);
        # only a --no-build-isolation build into an environment without it gets here.
        print("radixcache: Cython is not installed: building the pure-Python package only",
              file=sys.stderr)
        return []
    built = cythonize(
        [Extension(name, [f"radixcache/{name.rsplit('.', 1)[1]}.pyx"], include_dirs=INCLUDE,
                   depends=["radixcache/_include/*.h"])
         for name in ("radixcache._core_c", "radixcache._hybrid_c", "radixcache._blocks_c")],
        compiler_directives={"language_level": "3"})
    for ext in built:
        # After cythonize, which makes new Extension objects without the flag: without a
        # compiler the package still installs and runs on the pure modules.
        ext.optional = True
        if ext.name == "radixcache._blocks_c" and sys.platform.startswith("linux"):
            # rc_zmq.h binds libzmq's calls with dlopen/dladdr: in libdl before glibc 2.34
            ext.libraries.append("dl")
    return built


setup(ext_modules=extensions(), cmdclass={"build_ext": StrippedBuildExt})
