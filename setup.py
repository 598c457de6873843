"""Build of the CalRT binding ``calserve._calrt`` and (by default) the software runtime, and of
``calserve.vexp64`` (the sampler's float64 exp, ext/vexp64.c) and ``calserve.topp`` (its top-p cut,
ext/topp.c).

Build variables (environment):
  CALRT_IMPL=sim (default)  build ext/calrt/sim into ``calserve/libcalrt_sim.so`` next to the extension,
                            found at run time through rpath ``$ORIGIN``.
  CALRT_IMPL=vendor         link a vendor ``libcalrt`` instead: headers from ``$CALRT_HOME/include``,
                            library from ``$CALRT_HOME/lib`` (rpath set to it). No Python change needed.
The metadata lives in pyproject.toml; this file only declares the extension.

Every build output that lands where a running server may have it mapped (``calserve/`` of the source
tree, for ``build_ext --inplace`` and editable installs) is written under a temporary name in the
same directory and moved over the old one with ``os.replace``: a server that runs from this tree
keeps its mapped (now unlinked) copy instead of executing a file rewritten under it (which crashes
it on its next call into the C runtime). Never ``shutil.copy`` over a ``.so``: it truncates the file
in place (same inode).
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile

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


def replace_file(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` atomically: a temporary file beside ``dst``, then ``os.replace``
    (a new inode; whoever has the old file mapped keeps it)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(dst)}.", dir=os.path.dirname(os.path.abspath(dst)))
    try:
        with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
            shutil.copyfileobj(inp, out)
        shutil.copystat(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class BuildCalrt(build_ext):
    """Builds libcalrt_sim.so (sim builds) into the extension's output directory before linking;
    every output is moved into place atomically (module docstring)."""

    def copy_file(self, infile, outfile, preserve_mode=1, preserve_times=1, link=None, level=1):  # type: ignore[no-untyped-def,override]
        # setuptools copies the built extension into the source tree (--inplace, editable
        # installs) with distutils' copy_file, which rewrites the target in place.
        if os.path.isdir(outfile):
            outfile = os.path.join(outfile, os.path.basename(infile))
        replace_file(infile, outfile)
        return outfile, True

    def build_extension(self, ext: Extension) -> None:
        if IMPL == "sim" and ext.name == "calserve._calrt":
            self._build_sim(ext)
        out = os.path.abspath(self.get_ext_fullpath(ext.name))
        # The extension links to a temporary name, then replaces the old one.
        base, suffix = os.path.splitext(out)
        tmp = f"{base}.tmp-{os.getpid()}{suffix}"
        self._ext_tmp = tmp
        try:
            super().build_extension(ext)
            if os.path.exists(tmp):
                os.replace(tmp, out)
        finally:
            self._ext_tmp = None
            if os.path.exists(tmp):
                os.unlink(tmp)

    def get_ext_fullpath(self, ext_name: str) -> str:
        tmp = getattr(self, "_ext_tmp", None)
        return tmp if tmp else super().get_ext_fullpath(ext_name)

    def _build_sim(self, ext: Extension) -> None:
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
        tmp = os.path.join(out_dir, f".libcalrt_sim.so.tmp-{os.getpid()}")
        self.compiler.link_shared_object(objs, tmp, libraries=["m"], extra_postargs=["-pthread"])
        os.replace(tmp, lib)
        ext.library_dirs = [out_dir]
        # Editable installs run the extension from the source tree: keep a copy there too.
        src_pkg = os.path.join(HERE, "calserve")
        if os.path.abspath(out_dir) != os.path.abspath(src_pkg):
            replace_file(lib, os.path.join(src_pkg, "libcalrt_sim.so"))


setup(
    ext_modules=[
        Extension(
            "calserve._calrt",
            # the binding, and the host-driven multi-step decode over calrt.h (ext/host_steps.c)
            sources=[os.path.join("ext", "calserve_calrt.c"), os.path.join("ext", "host_steps.c")],
            include_dirs=include_dirs + [numpy.get_include()],
            library_dirs=library_dirs,
            libraries=libraries,
            runtime_library_dirs=rpath,
            extra_compile_args=CFLAGS,
            extra_link_args=["-ldl"],
        ),
        # the sampler's float64 exp, vectorised with glibc's bits (ext/vexp64.c; no CalRT)
        Extension(
            "calserve.vexp64",
            sources=[os.path.join("ext", "vexp64.c")],
            extra_compile_args=CFLAGS,
            libraries=["m"],
        ),
        # the top-p cut of the sampler's weights, numpy's arithmetic in two passes (ext/topp.c)
        Extension(
            "calserve.topp",
            sources=[os.path.join("ext", "topp.c")],
            extra_compile_args=CFLAGS,
        ),
    ],
    cmdclass={"build_ext": BuildCalrt},
)
