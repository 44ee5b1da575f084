"""Build hook for the one optional C extension; the project itself is described in pyproject.toml.

``kvtier.core._chainhash`` (the chain of block keys in one C loop over OpenSSL's
SHA-256) is optional: without a compiler or OpenSSL's headers the install goes
on and ``kvtier.core.keys`` computes the same keys in Python, slower.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.core._chainhash", ["kvtier/core/_chainhash.c"],
                             libraries=["crypto"], optional=True)])
