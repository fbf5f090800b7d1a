"""Build hook: compiles native/*.c into ktconvert/native/_ktnative.so, a plain C library loaded with ctypes.

The library uses no Python API and is not named after one (no ``.cpython-311-...`` suffix), so one wheel serves every
Python >= 3.11: it is tagged ``py3-none-<platform>``. It is compiled without debug info and stripped. Every
ISA-specific function carries its own ``__attribute__((target(...)))`` and the CPU is probed at run time, so nothing
here depends on the build host's flags. A failed compile is not fatal: ktconvert then runs its numpy reference paths
and says so in ``ktconvert env`` (and the wheel is tagged ``py3-none-any``).
"""
import glob
import os
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext

LIB_NAME = "ktconvert.native._ktnative"


def _not_built(exc: Exception) -> None:
    print(f"ktconvert: native library not built ({exc}); numpy fallback will be used", file=sys.stderr)


class NativeLibBuild(build_ext):
    """build_ext for a ctypes library: ABI-free file name, sources compiled on every core, no stale siblings,
    failures soft."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def get_export_symbols(self, ext):
        return ext.export_symbols   # no PyInit_* entry point: this is not a Python module

    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing: fall back to numpy
            _not_built(exc)
        if self.inplace:
            self._remove_stale_libraries()

    def build_extensions(self):
        # The interpreter's link line may carry -Wl,-rpath,<its lib dir>: the library needs no libpython, and a path
        # of the build host has no place in it.
        self.compiler.linker_so = [arg for arg in self.compiler.linker_so if not arg.startswith("-Wl,-rpath")]
        self._compile_in_parallel()
        super().build_extensions()

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            _not_built(exc)

    def _compile_in_parallel(self) -> None:
        """One compiler process per source file, as many at a time as there are cores (build_ext's own --parallel
        only runs separate extensions side by side)."""
        compile_sources = self.compiler.compile

        def compile_each(sources, **kwargs):
            with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
                return [obj for objs in pool.map(lambda s: compile_sources([s], **kwargs), sources) for obj in objs]

        self.compiler.compile = compile_each

    def _remove_stale_libraries(self) -> None:
        """An in-place build (pip install -e .) of an older version left _ktnative.cpython-*.so next to the new
        _ktnative.so; the loader would prefer it, so it goes."""
        for ext in self.extensions:
            built = os.path.abspath(self.get_ext_fullpath(ext.name))
            for path in glob.glob(os.path.join(os.path.dirname(built), "_ktnative*.so")):
                if os.path.abspath(path) != built and os.path.exists(built):
                    os.remove(path)


class PlatformWheel(bdist_wheel):
    """py3-none-<platform> when the native library was built (no Python ABI in it), py3-none-any otherwise."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return ("py3", "none", platform if self._library_built() else "any")

    def _library_built(self) -> bool:
        cmd = self.get_finalized_command("build_ext")
        return any(os.path.isfile(os.path.join(cmd.build_lib, cmd.get_ext_filename(ext.name)))
                   for ext in cmd.extensions or [])


def native_extension() -> list[Extension]:
    sources = sorted(glob.glob(os.path.join("native", "*.c")))
    if not sources:
        return []
    linux = sys.platform.startswith("linux")
    return [Extension(
        LIB_NAME,
        sources=sources,
        depends=sorted(glob.glob(os.path.join("native", "*.h"))),  # rebuild on header edits
        include_dirs=["native"],
        # No -march / -m<isa> flags: ISA code is selected at run time. -ffp-contract=off keeps x * inv a plain fp32
        # product (no FMA contraction) wherever bytes must match the numpy reference. -g0 overrides Python's -g.
        extra_compile_args=["-O3", "-g0", "-std=c11", "-fno-strict-aliasing", "-fvisibility=hidden",
                            "-ffp-contract=off"],
        extra_link_args=["-lpthread", "-lm"] + (["-s"] if linux else []),
    )]


# Every package under ktconvert/ (found, never listed by hand) plus the top-level manifests/ folder, which ships as
# the package ktconvert.manifests.
packages = find_packages(include=["ktconvert", "ktconvert.*"]) + ["ktconvert.manifests"]

setup(packages=packages, package_dir={"ktconvert.manifests": "manifests"}, ext_modules=native_extension(),
      cmdclass={"build_ext": NativeLibBuild, "bdist_wheel": PlatformWheel})
