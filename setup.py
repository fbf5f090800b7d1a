"""Build hook: compiles native/*.c into ktconvert/native/_ktnative (a plain C library loaded with ctypes).

Every ISA-specific function carries its own ``__attribute__((target(...)))`` and the CPU is probed at run time,
so nothing here depends on the build host's flags. A failed compile is not fatal: ktconvert then runs its numpy
reference paths and says so in ``ktconvert env``.
"""
import glob
import os
import sys

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext


class OptionalBuildExt(build_ext):
    def run(self):
        try:
            super().run()
        except Exception as exc:  # compiler missing: fall back to numpy
            print(f"ktconvert: native library not built ({exc}); numpy fallback will be used", file=sys.stderr)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"ktconvert: native library not built ({exc}); numpy fallback will be used", file=sys.stderr)


sources = sorted(glob.glob(os.path.join("native", "*.c")))
ext_modules = []
if sources:
    ext_modules.append(
        Extension(
            "ktconvert.native._ktnative",
            sources=sources,
            depends=sorted(glob.glob(os.path.join("native", "*.h"))),  # rebuild on header edits; ship them in sdists
            include_dirs=["native"],
            # No -march / -m<isa> flags: ISA code is selected at run time. -ffp-contract=off keeps x * inv a plain
            # fp32 product (no FMA contraction) wherever bytes must match the numpy reference.
            extra_compile_args=["-O3", "-std=c11", "-fno-strict-aliasing", "-fvisibility=hidden", "-ffp-contract=off"],
            extra_link_args=["-lpthread", "-lm"],
        )
    )

# Every package under ktconvert/ (found, never listed by hand) plus the top-level manifests/ folder, which ships as
# the package ktconvert.manifests.
packages = find_packages(include=["ktconvert", "ktconvert.*"]) + ["ktconvert.manifests"]

setup(packages=packages, package_dir={"ktconvert.manifests": "manifests"}, ext_modules=ext_modules,
      cmdclass={"build_ext": OptionalBuildExt})
