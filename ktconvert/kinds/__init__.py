"""The output kinds a conversion writes: ``KINDS`` (kinds.base) holds them, and importing this package registers
the two ktconvert ships (importing the modules that declare them): ``cpu`` (kt-kernel's CPU expert files) and
``gpu`` (the SGLang-KT GPU checkpoint). api, the command line, the targets, planning, verify and the results ask
KINDS and never name a kind.
"""
from ktconvert.kinds import cpu, gpu  # noqa: F401  (registers the kinds)
from ktconvert.kinds.base import KINDS, OutputKind, kind_of, kinds, register
from ktconvert.run.options import option

__all__ = ["KINDS", "OutputKind", "kind_of", "kinds", "option", "register"]
