"""Build: the C++ simulator (csrc/) through CMakeLists.txt + pybind11 into ``fastpo._C``.

The folders ``kernels/`` and ``envs/`` are installed as ``fastpo.kernels`` and ``fastpo.envs`` (never as
top-level packages: both names are taken on PyPI). Extra CMake arguments can be passed through the
environment variable ``FASTPO_CMAKE_ARGS`` (e.g. ``-DFASTPO_SANITIZE=ON``).
"""

import os
import shlex
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()


class CMakeExtension(Extension):
    def __init__(self, name: str, sourcedir: Path):
        super().__init__(name, sources=[])
        self.sourcedir = str(sourcedir)


class CMakeBuild(build_ext):
    def build_extension(self, ext: CMakeExtension) -> None:
        import pybind11

        extdir = Path(self.get_ext_fullpath(ext.name)).parent.resolve()
        build_type = os.environ.get("FASTPO_BUILD_TYPE", "Debug" if self.debug else "Release")
        build_temp = Path(self.build_temp).resolve() / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-DCMAKE_BUILD_TYPE={build_type}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            *shlex.split(os.environ.get("FASTPO_CMAKE_ARGS", "")),
        ]
        subprocess.run(["cmake", ext.sourcedir, *args], cwd=build_temp, check=True)
        jobs = str(max(1, os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", ".", "--parallel", jobs], cwd=build_temp, check=True)


def packages() -> tuple[list[str], dict[str, str]]:
    pkgs = ["fastpo"] + [f"fastpo.{p}" for p in find_packages("fastpo")]
    pkg_dir = {"fastpo": "fastpo"}
    for folder in ("kernels", "envs"):
        pkgs.append(f"fastpo.{folder}")
        pkgs += [f"fastpo.{folder}.{p}" for p in find_packages(folder)]
        pkg_dir[f"fastpo.{folder}"] = folder
    return pkgs, pkg_dir


pkgs, pkg_dir = packages()
setup(
    packages=pkgs,
    package_dir=pkg_dir,
    package_data={"fastpo": ["assets/**/*"]},
    ext_modules=[CMakeExtension("fastpo._C", ROOT)],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
