"""Optional native library (built from native/*.c by the package build); numpy paths are used without it."""
