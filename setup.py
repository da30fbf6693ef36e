"""Builds the fused CPU ops of the hot path (torchrec_hybrid/csrc, a torch.library extension) with the package.

Everything else is in pyproject.toml. The extension needs torch at build time: scripts/setup.sh installs
with ``--no-build-isolation``. Without it (``TORCHREC_HYBRID_NO_EXT=1``, or a build that fails) the package
runs its composed fallback (torchrec_hybrid/sharding/composed.py) instead.
"""

import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("TORCHREC_HYBRID_NO_EXT") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    ext_modules = [CppExtension("torchrec_hybrid._hybrid_ops", ["torchrec_hybrid/csrc/hybrid_ops.cpp"],
                                extra_compile_args=["-O3"])]
    cmdclass = {"build_ext": BuildExtension.with_options(no_python_abi_suffix=True)}

setup(ext_modules=ext_modules, cmdclass=cmdclass)
