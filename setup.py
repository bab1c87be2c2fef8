"""Only cythonizes; all metadata lives in pyproject.toml."""

from Cython.Build import cythonize
from setuptools import Extension, setup

extensions = [
    # optional: without a compiler the package still installs and runs on the pure core.
    Extension("radixcache._core_c", ["radixcache/_core_c.pyx"], optional=True),
]

setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": "3"}))
