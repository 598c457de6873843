"""Build of the CalRT binding ``calserve._calrt`` and (by default) the software runtime.

Build variables (environment):
  CALRT_IMPL=sim (default)  build ext/calrt/sim into ``calserve/libcalrt_sim.so`` next to the extension,
                            found at run time through rpath ``$ORIGIN``.
  CALRT_IMPL=vendor         link a vendor ``libcalrt`` instead: headers from ``$CALRT_HOME/include``,
                            library from ``$CALRT_HOME/lib`` (rpath set to it). No Python change needed.
The metadata lives in pyproject.toml; this file only declares the extension.
"""

from __future__ import annotations

import glob
import os
import shutil

import numpy
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
IMPL = os.environ.get("CALRT_IMPL", "sim")
CFLAGS = ["-std=c11", "-O3", "-D_GNU_SOURCE", "-ffp-contract=off", "-pthread", "-Wall",
          "-Wno-unused-parameter"]

if IMPL == "sim":
    include_dirs = [os.path.join("ext", "calrt", "include")]
    library_dirs: list[str] = []
    libraries = ["calrt_sim"]
    rpath = ["$ORIGIN"]
elif IMPL == "vendor":
    home = os.environ.get("CALRT_HOME")
    if not home:
        raise SystemExit("CALRT_IMPL=vendor needs CALRT_HOME (with include/calrt.h and lib/libcalrt.so)")
    include_dirs = [os.path.join(home, "include")]
    library_dirs = [os.path.join(home, "lib")]
    libraries = ["calrt"]
    rpath = [os.path.join(home, "lib")]
else:
    raise SystemExit(f"CALRT_IMPL must be 'sim' or 'vendor', not {IMPL!r}")


class BuildCalrt(build_ext):
    """Builds libcalrt_sim.so (sim builds) into the extension's output directory before linking."""

    def build_extension(self, ext: Extension) -> None:
        if IMPL == "sim":
            out_dir = os.path.dirname(os.path.abspath(self.get_ext_fullpath(ext.name)))
            os.makedirs(out_dir, exist_ok=True)
            srcs = sorted(glob.glob(os.path.join("ext", "calrt", "sim", "*.c")))
            objs = self.compiler.compile(
                srcs,
                output_dir=self.build_temp,
                include_dirs=[os.path.join("ext", "calrt", "include"), os.path.join("ext", "calrt", "sim")],
                extra_postargs=CFLAGS + ["-fPIC"],
            )
            lib = os.path.join(out_dir, "libcalrt_sim.so")
            self.compiler.link_shared_object(objs, lib, libraries=["m"], extra_postargs=["-pthread"])
            ext.library_dirs = [out_dir]
            # Editable installs run the extension from the source tree: keep a copy there too.
            src_pkg = os.path.join(HERE, "calserve")
            if os.path.abspath(out_dir) != os.path.abspath(src_pkg):
                shutil.copy2(lib, os.path.join(src_pkg, "libcalrt_sim.so"))
        super().build_extension(ext)


setup(
    ext_modules=[
        Extension(
            "calserve._calrt",
            sources=[os.path.join("ext", "calserve_calrt.c")],
            include_dirs=include_dirs + [numpy.get_include()],
            library_dirs=library_dirs,
            libraries=libraries,
            runtime_library_dirs=rpath,
            extra_compile_args=CFLAGS,
            extra_link_args=["-ldl"],
        )
    ],
    cmdclass={"build_ext": BuildCalrt},
)
