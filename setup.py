"""Only cythonizes; all metadata lives in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

# The C helpers both extensions include (radixcache/_include/*.h).
INCLUDE = ["radixcache/_include"]

extensions = [
    # optional: without a compiler the package still installs and runs on the pure modules.
    Extension("radixcache._core_c", ["radixcache/_core_c.pyx"], include_dirs=INCLUDE,
              depends=["radixcache/_include/*.h"], optional=True),
    Extension("radixcache._blocks_c", ["radixcache/_blocks_c.pyx"], include_dirs=INCLUDE,
              depends=["radixcache/_include/*.h"], optional=True),
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
