"""The one compiled part: ``bus._chaincore`` (the prompt key chain's inner loop, see
``bus/_native/chaincore.c``). Everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "bus._chaincore",
            sources=["bus/_native/chaincore.c"],
            depends=["bus/_native/xxhash.h"],
            include_dirs=["bus/_native"],
            extra_compile_args=["-O3"],
        )
    ]
)
